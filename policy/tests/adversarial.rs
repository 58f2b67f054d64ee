#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The adversarial catalogue for the policy crate (research/sandbox.md §10 items 1, 2, 3, 5, 7,
//! 8, 24, 27): hostile ids, branches, env entries and paths, and a resolver attacked with real
//! symlinks, swaps, loops, FIFOs, hard links and bind mounts in temporary directories.
//!
//! Resolver cases run twice through `both!`, once on the `openat2` path and once on the
//! component-walk fallback, so an old kernel gets the same guarantees. Bind-mount cases need
//! root (as CI and the developers' machines run); a failing `mount` fails the test loudly.

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use agentbox_policy::env::{self, Allowlist, DropReason, Limits};
use agentbox_policy::id::{AgentBranch, Tid};
use agentbox_policy::path::{self, EqualsRoot, PathReason, RelPath, RequestPath};
use agentbox_policy::resolve::{Kind, ResolveError, Root, Strategy};
use rustix::fs::{CWD, FileType, Mode, RenameFlags};

// ---------------------------------------------------------------------------------------------
// Fixtures

/// One `#[test]` per case, named after the attack, each calling `$check` once per argument
/// tuple, so the catalogue reads as a list and a failure still names its case.
macro_rules! cases {
    ($check:ident { $($name:ident: $(($($arg:expr),+)),+;)+ }) => {
        $(
            #[test]
            fn $name() {
                $($check($($arg),+);)+
            }
        )+
    };
}

fn rel(s: &str) -> RelPath {
    RelPath::parse(s).unwrap()
}

fn mkdirs(base: &Path, rels: &[&str]) {
    for r in rels {
        std::fs::create_dir_all(base.join(r)).unwrap();
    }
}

fn root(tmp: &Path, strategy: Strategy) -> Root {
    Root::open(tmp).unwrap().with_strategy(strategy)
}

/// Defines a module with one test per resolver strategy for the same body.
macro_rules! both {
    ($name:ident, |$s:ident| $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            fn case($s: Strategy) $body
            #[test]
            fn openat2() {
                case(Strategy::Openat2);
            }
            #[test]
            fn fallback() {
                case(Strategy::Fallback);
            }
        }
    };
}

/// Atomically exchanges two directory entries (`renameat2` with `RENAME_EXCHANGE`).
fn exchange(a: impl AsRef<Path>, b: impl AsRef<Path>) {
    rustix::fs::renameat_with(CWD, a.as_ref(), CWD, b.as_ref(), RenameFlags::EXCHANGE).unwrap();
}

/// A temp dir holding `dirs` and one symlink at `link` pointing to `target`.
fn tree_with_link(dirs: &[&str], target: &str, link: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    mkdirs(tmp.path(), dirs);
    symlink(target, tmp.path().join(link)).unwrap();
    tmp
}

/// `layout` (the dirs, a symlink's target, the symlink) built in a temp dir: resolving each of
/// `paths`, and each of `dir_paths` as a directory, is refused as a symlink.
#[track_caller]
fn refuses_link(s: Strategy, layout: (&[&str], &str, &str), paths: &[&str], dir_paths: &[&str]) {
    let (dirs, target, link) = layout;
    let tmp = tree_with_link(dirs, target, link);
    let root = root(tmp.path(), s);
    for p in paths {
        assert_symlink(root.resolve(&rel(p)));
    }
    for p in dir_paths {
        assert_symlink(root.resolve_dir(&rel(p)));
    }
}

#[track_caller]
fn assert_symlink(r: Result<agentbox_policy::resolve::Resolved, ResolveError>) {
    match r {
        Err(ResolveError::Symlink { .. }) => {}
        other => panic!("expected a symlink refusal, got {other:?}"),
    }
}

#[track_caller]
fn assert_mount(r: Result<agentbox_policy::resolve::Resolved, ResolveError>) {
    match r {
        Err(ResolveError::CrossesMount { .. }) => {}
        other => panic!("expected a mount-crossing refusal, got {other:?}"),
    }
}

/// Unmounts on drop so a failing assertion does not leave a mount behind; declared after the
/// `TempDir` so it is dropped first.
struct MountGuard {
    target: PathBuf,
}

impl MountGuard {
    fn bind(source: &Path, target: &Path) -> MountGuard {
        let out = Command::new("mount")
            .arg("--bind")
            .arg(source)
            .arg(target)
            .output()
            .expect("mount(8) must be runnable");
        assert!(
            out.status.success(),
            "bind mount failed (these tests run as root and must not skip): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        MountGuard {
            target: target.to_owned(),
        }
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.target)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.target).status();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Resolver: symlinks

both!(symlink_as_first_component, |s| {
    refuses_link(s, (&["real/sub"], "real", "link"), &["link/sub"], &["link"]);
});

both!(symlink_as_middle_component, |s| {
    refuses_link(s, (&["a/real/c"], "real", "a/b"), &["a/b/c"], &[]);
});

both!(symlink_as_last_component_to_file, |s| {
    let tmp = tempfile::tempdir().unwrap();
    mkdirs(tmp.path(), &["a"]);
    std::fs::write(tmp.path().join("a/target"), b"x").unwrap();
    symlink("target", tmp.path().join("a/l")).unwrap();
    assert_symlink(root(tmp.path(), s).resolve(&rel("a/l")));
});

both!(symlink_as_last_component_to_dir, |s| {
    refuses_link(s, (&["a/d"], "d", "a/l"), &[], &["a/l"]);
});

both!(absolute_symlink_to_etc, |s| {
    refuses_link(s, (&[], "/etc", "etc"), &["etc/passwd", "etc"], &[]);
});

both!(absolute_symlink_to_filesystem_root, |s| {
    refuses_link(s, (&[], "/", "slash"), &["slash/etc/shadow"], &[]);
});

both!(relative_dotdot_symlink_escaping, |s| {
    refuses_link(s, (&["a/b"], "../../..", "a/b/up"), &["a/b/up/etc"], &[]);
});

both!(relative_dotdot_symlink_staying_inside, |s| {
    // Even a link that stays inside the root is refused: the rule is "no symlinks", not "no
    // escaping symlinks", because an in-tree link can still point at another task's files.
    let layout = (
        &["tasks/t1", "tasks/t2/workspace"][..],
        "../t2/workspace",
        "tasks/t1/workspace",
    );
    refuses_link(s, layout, &[], &["tasks/t1/workspace"]);
});

both!(symlink_to_proc_magic_link, |s| {
    refuses_link(s, (&[], "/proc/self/root", "proc"), &["proc/etc"], &[]);
});

both!(symlink_loop_between_two_links, |s| {
    let tmp = tempfile::tempdir().unwrap();
    symlink("b", tmp.path().join("a")).unwrap();
    symlink("a", tmp.path().join("b")).unwrap();
    let root = root(tmp.path(), s);
    assert_symlink(root.resolve(&rel("a")));
    assert_symlink(root.resolve(&rel("a/x")));
});

both!(symlink_self_loop, |s| {
    refuses_link(s, (&[], "me", "me"), &["me"], &[]);
});

both!(dangling_symlink, |s| {
    let tmp = tree_with_link(&[], "nowhere", "d");
    assert_symlink(root(tmp.path(), s).resolve(&rel("d")));
    assert!(
        !tmp.path().join("nowhere").exists(),
        "nothing may be created"
    );
});

both!(symlink_chain_to_inside_dir, |s| {
    let tmp = tempfile::tempdir().unwrap();
    mkdirs(tmp.path(), &["real"]);
    symlink("real", tmp.path().join("l1")).unwrap();
    symlink("l1", tmp.path().join("l2")).unwrap();
    assert_symlink(root(tmp.path(), s).resolve(&rel("l2")));
});

both!(symlink_deep_in_long_path, |s| {
    let tmp = tempfile::tempdir().unwrap();
    let deep: Vec<String> = (0..150).map(|i| format!("d{i}")).collect();
    let deep = deep.join("/");
    mkdirs(tmp.path(), &[&deep]);
    let root = root(tmp.path(), s);
    root.resolve_dir(&rel(&deep)).unwrap();
    let parent = tmp.path().join(&deep).join("x");
    std::fs::create_dir(&parent).unwrap();
    symlink("/", parent.join("l")).unwrap();
    assert_symlink(root.resolve(&rel(&format!("{deep}/x/l/etc"))));
});

// ---------------------------------------------------------------------------------------------
// Resolver: swaps and re-checks (TOCTOU)

both!(dir_swapped_for_symlink_before_recheck, |s| {
    let tmp = tempfile::tempdir().unwrap();
    mkdirs(tmp.path(), &["tasks/t1/workspace"]);
    let root = root(tmp.path(), s);
    let ws = root.resolve_dir(&rel("tasks/t1/workspace")).unwrap();
    ws.recheck(&root).unwrap();
    let p = tmp.path().join("tasks/t1");
    std::fs::rename(p.join("workspace"), p.join("workspace.old")).unwrap();
    symlink("workspace.old", p.join("workspace")).unwrap();
    let err = ws.recheck(&root).unwrap_err();
    assert!(matches!(err, ResolveError::Symlink { .. }), "{err}");
});

both!(parent_swapped_for_symlink_before_recheck, |s| {
    let tmp = tempfile::tempdir().unwrap();
    mkdirs(tmp.path(), &["tasks/t1/workspace"]);
    let root = root(tmp.path(), s);
    let ws = root.resolve_dir(&rel("tasks/t1/workspace")).unwrap();
    let p = tmp.path().join("tasks");
    std::fs::rename(p.join("t1"), p.join("t1.old")).unwrap();
    symlink("t1.old", p.join("t1")).unwrap();
    assert!(matches!(
        ws.recheck(&root).unwrap_err(),
        ResolveError::Symlink { .. }
    ));
});

both!(dir_exchanged_with_other_dir_before_recheck, |s| {
    let tmp = tempfile::tempdir().unwrap();
    mkdirs(tmp.path(), &["ws", "other"]);
    let root = root(tmp.path(), s);
    let ws = root.resolve_dir(&rel("ws")).unwrap();
    exchange(tmp.path().join("ws"), tmp.path().join("other"));
    assert!(matches!(
        ws.recheck(&root).unwrap_err(),
        ResolveError::Changed { .. }
    ));
});

both!(file_replaced_before_recheck, |s| {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("f");
    std::fs::write(&f, b"1").unwrap();
    let root = root(tmp.path(), s);
    let r = root.resolve(&rel("f")).unwrap();
    // Write the replacement first so the inode number cannot simply be reused.
    std::fs::write(tmp.path().join("f.new"), b"2").unwrap();
    std::fs::rename(tmp.path().join("f.new"), &f).unwrap();
    assert!(matches!(
        r.recheck(&root).unwrap_err(),
        ResolveError::Changed { .. }
    ));
});

both!(deleted_before_recheck, |s| {
    let tmp = tempfile::tempdir().unwrap();
    mkdirs(tmp.path(), &["gone"]);
    let root = root(tmp.path(), s);
    let r = root.resolve_dir(&rel("gone")).unwrap();
    std::fs::remove_dir(tmp.path().join("gone")).unwrap();
    assert!(matches!(
        r.recheck(&root).unwrap_err(),
        ResolveError::NotFound { .. }
    ));
});

both!(recheck_against_another_root, |s| {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    mkdirs(a.path(), &["x"]);
    mkdirs(b.path(), &["x"]);
    let ra = root(a.path(), s);
    let rb = root(b.path(), s);
    let x = ra.resolve_dir(&rel("x")).unwrap();
    assert!(matches!(
        x.recheck(&rb).unwrap_err(),
        ResolveError::OtherRoot { .. }
    ));
});

both!(race_exchange_dir_and_symlink, |s| {
    // A thread keeps atomically exchanging the workspace with a symlink to /etc while we
    // resolve it: every success must be the real workspace, every failure a symlink refusal.
    let tmp = tree_with_link(&["ws"], "/etc", "evil");
    let root = root(tmp.path(), s);
    let ws_id = *root.resolve_dir(&rel("ws")).unwrap().identity();
    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let stop = Arc::clone(&stop);
        let (a, b) = (tmp.path().join("ws"), tmp.path().join("evil"));
        std::thread::spawn(move || {
            let mut swaps = 0u64;
            while !stop.load(Ordering::Relaxed) {
                exchange(&a, &b);
                swaps += 1;
            }
            swaps
        })
    };
    let (mut ok, mut refused, mut tries) = (0u64, 0u64, 0u64);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    // Keep going until the race was really observed from both sides (and at least 3000 tries).
    while tries < 3000 || ok == 0 || refused == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "race never observed: ok={ok} refused={refused}"
        );
        tries += 1;
        match root.resolve_dir(&rel("ws")) {
            Ok(r) => {
                assert!(
                    r.identity().same_object(&ws_id),
                    "resolved a foreign object"
                );
                ok += 1;
            }
            Err(ResolveError::Symlink { .. }) => refused += 1,
            Err(e) => panic!("unexpected error under race: {e}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = swapper.join().unwrap();
    assert!(swaps > 0);
});

// ---------------------------------------------------------------------------------------------
// Resolver: mounts (we run as root)

both!(bind_mount_as_last_component, |s| {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    mkdirs(tmp.path(), &["tasks/t1/workspace"]);
    let _m = MountGuard::bind(outside.path(), &tmp.path().join("tasks/t1/workspace"));
    assert_mount(root(tmp.path(), s).resolve_dir(&rel("tasks/t1/workspace")));
});

both!(bind_mount_as_middle_component, |s| {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    mkdirs(outside.path(), &["workspace"]);
    mkdirs(tmp.path(), &["tasks/t1"]);
    let _m = MountGuard::bind(outside.path(), &tmp.path().join("tasks/t1"));
    assert_mount(root(tmp.path(), s).resolve_dir(&rel("tasks/t1/workspace")));
});

both!(bind_mount_from_inside_same_filesystem, |s| {
    // Same filesystem, same st_dev: only the mount id shows the crossing.
    let tmp = tempfile::tempdir().unwrap();
    mkdirs(tmp.path(), &["a", "b"]);
    let _m = MountGuard::bind(&tmp.path().join("a"), &tmp.path().join("b"));
    let root = root(tmp.path(), s);
    let a = root.resolve_dir(&rel("a")).unwrap();
    let b_stat = std::fs::metadata(tmp.path().join("b")).unwrap();
    assert_eq!(
        std::os::unix::fs::MetadataExt::dev(&b_stat),
        a.identity().dev
    );
    assert_mount(root.resolve_dir(&rel("b")));
});

both!(bind_mount_placed_after_resolve_fails_recheck, |s| {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    mkdirs(tmp.path(), &["ws"]);
    let root = root(tmp.path(), s);
    let ws = root.resolve_dir(&rel("ws")).unwrap();
    let _m = MountGuard::bind(outside.path(), &tmp.path().join("ws"));
    assert!(matches!(
        ws.recheck(&root).unwrap_err(),
        ResolveError::CrossesMount { .. }
    ));
});

// ---------------------------------------------------------------------------------------------
// Resolver: object types and handle properties

both!(fifo_as_last_component_does_not_block, |s| {
    let tmp = tempfile::tempdir().unwrap();
    rustix::fs::mknodat(
        CWD,
        tmp.path().join("fifo"),
        FileType::Fifo,
        Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let path = tmp.path().to_owned();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let root = Root::open(&path).unwrap().with_strategy(s);
        let kind = root
            .resolve(&RelPath::parse("fifo").unwrap())
            .map(|r| r.kind());
        let _ = tx.send(kind.map_err(|e| e.to_string()));
    });
    let kind = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("resolving a FIFO blocked");
    assert_eq!(kind.unwrap(), Kind::Fifo);
});

both!(socket_kind_checked, |s| {
    let tmp = tempfile::tempdir().unwrap();
    mkdirs(tmp.path(), &["sockets/t1"]);
    let _l =
        std::os::unix::net::UnixListener::bind(tmp.path().join("sockets/t1/llm.sock")).unwrap();
    let root = root(tmp.path(), s);
    let r = root.resolve(&rel("sockets/t1/llm.sock")).unwrap();
    r.expect_socket().unwrap();
    assert!(r.expect_dir().is_err());
    root.resolve_kind(&rel("sockets/t1/llm.sock"), Kind::Socket)
        .unwrap();
    assert!(matches!(
        root.resolve_kind(&rel("sockets/t1/llm.sock"), Kind::File)
            .unwrap_err(),
        ResolveError::WrongKind {
            expected: Kind::File,
            found: Kind::Socket,
            ..
        }
    ));
});

both!(hard_link_reports_nlink, |s| {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("f"), b"x").unwrap();
    std::fs::hard_link(tmp.path().join("f"), tmp.path().join("g")).unwrap();
    let r = root(tmp.path(), s).resolve(&rel("f")).unwrap();
    assert_eq!(r.identity().nlink, 2);
    assert_eq!(r.kind(), Kind::File);
});

both!(char_device_kind, |s| {
    let root = Root::open("/dev").unwrap().with_strategy(s);
    let r = root.resolve(&rel("null")).unwrap();
    assert_eq!(r.kind(), Kind::CharDev);
    assert!(r.expect_file().is_err());
});

both!(file_where_dir_expected, |s| {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("f"), b"x").unwrap();
    let err = root(tmp.path(), s).resolve_dir(&rel("f")).unwrap_err();
    assert!(
        matches!(
            err,
            ResolveError::WrongKind { .. } | ResolveError::NotADirectory { .. }
        ),
        "{err}"
    );
});

both!(file_as_middle_component, |s| {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("f"), b"x").unwrap();
    assert!(matches!(
        root(tmp.path(), s).resolve(&rel("f/x")).unwrap_err(),
        ResolveError::NotADirectory { .. }
    ));
});

both!(missing_component_is_not_created, |s| {
    let tmp = tempfile::tempdir().unwrap();
    let root = root(tmp.path(), s);
    assert!(matches!(
        root.resolve_dir(&rel("tasks/t1")).unwrap_err(),
        ResolveError::NotFound { .. }
    ));
    assert!(!tmp.path().join("tasks").exists());
});

both!(handle_is_o_path_and_cloexec, |s| {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("f"), b"secret").unwrap();
    let r = root(tmp.path(), s).resolve(&rel("f")).unwrap();
    let flags = rustix::io::fcntl_getfd(r.as_fd()).unwrap();
    assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
    let mut buf = [0u8; 8];
    // An O_PATH handle cannot be read: the resolver never opens anything for I/O.
    assert_eq!(
        rustix::io::read(r.as_fd(), &mut buf).unwrap_err(),
        rustix::io::Errno::BADF
    );
});

both!(empty_relative_path_is_the_root, |s| {
    let tmp = tempfile::tempdir().unwrap();
    let root = root(tmp.path(), s);
    let me = root.resolve_dir(&RelPath::empty()).unwrap();
    assert!(me.identity().same_object(root.identity()));
    me.recheck(&root).unwrap();
});

#[test]
fn root_last_component_symlink_refused() {
    let tmp = tree_with_link(&["real"], "real", "link");
    assert!(matches!(
        Root::open(tmp.path().join("link")).unwrap_err(),
        ResolveError::Symlink { .. }
    ));
}

#[test]
fn root_parent_symlink_tolerated() {
    // The root path is trusted configuration: only its last component must not be a link.
    let tmp = tree_with_link(&["real/data"], "real", "link");
    Root::open(tmp.path().join("link/data")).unwrap();
}

#[test]
fn root_not_a_directory_or_relative_refused() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("f"), b"").unwrap();
    assert!(matches!(
        Root::open(tmp.path().join("f")).unwrap_err(),
        ResolveError::WrongKind { .. }
    ));
    assert!(matches!(
        Root::open("relative/dir").unwrap_err(),
        ResolveError::RootNotAbsolute { .. }
    ));
}

#[test]
fn root_swapped_detected_by_root_recheck() {
    let tmp = tempfile::tempdir().unwrap();
    mkdirs(tmp.path(), &["data", "other"]);
    let root = Root::open(tmp.path().join("data")).unwrap();
    exchange(tmp.path().join("data"), tmp.path().join("other"));
    assert!(matches!(
        root.recheck().unwrap_err(),
        ResolveError::Changed { .. }
    ));
}

#[test]
fn openat2_is_available_on_this_kernel() {
    // Guards against the strict strategy silently degrading: Linux 6.x must take the fast path.
    let tmp = tempfile::tempdir().unwrap();
    mkdirs(tmp.path(), &["a"]);
    Root::open(tmp.path())
        .unwrap()
        .with_strategy(Strategy::Openat2)
        .resolve_dir(&rel("a"))
        .unwrap();
}

#[test]
fn dotdot_cannot_reach_the_resolver() {
    for bad in ["..", "a/../b", "./a", "/etc", "a//b", "a/"] {
        assert!(RelPath::parse(bad).is_err(), "{bad:?}");
    }
    assert!(RelPath::empty().join("..").is_err());
}

// ---------------------------------------------------------------------------------------------
// Task ids

fn tid_refused(s: &str) {
    assert!(Tid::parse(s).is_err(), "{s:?} accepted");
    assert!(serde_json::from_value::<Tid>(serde_json::Value::String(s.into())).is_err());
}

cases!(tid_refused {
    tid_trailing_newline: ("task\n");
    tid_nul: ("task\0x");
    tid_uppercase: ("Task");
    tid_cyrillic_a: ("t\u{0430}sk");
    tid_fullwidth_digits: ("\u{FF11}\u{FF12}");
    tid_empty: ("");
    tid_leading_dash: ("-rf");
    tid_path_like: (".."), ("a/b"), ("a.b"), ("."), ("a b"), ("a\tb");
});

#[test]
fn tid_65_chars() {
    tid_refused(&"a".repeat(65));
    assert!(Tid::parse(&"a".repeat(64)).is_ok());
}

// ---------------------------------------------------------------------------------------------
// Branches

fn branch_refused(s: &str) {
    assert!(AgentBranch::parse(s).is_err(), "{s:?} accepted");
}

cases!(branch_refused {
    branch_main: ("main");
    branch_full_ref: ("refs/heads/agent/x");
    branch_force_refspec: ("+agent/x");
    branch_refspec_to_main: ("agent/x:refs/heads/main");
    branch_option_injection: ("--upload-pack=touch /tmp/x"), ("-c");
    branch_empty_tid: ("agent/");
    branch_uppercase_tid: ("agent/X");
    branch_nested: ("agent/a/b");
});

#[test]
fn branch_accepted_exactly() {
    let b = AgentBranch::parse("agent/t-1").unwrap();
    assert_eq!(b.refname(), "refs/heads/agent/t-1");
    assert_eq!(b.tid().as_str(), "t-1");
}

// ---------------------------------------------------------------------------------------------
// Environment

fn operator_allowlist() -> Allowlist {
    Allowlist::new(["CLAUDE_CODE_MAX_OUTPUT_TOKENS", "MAX_THINKING_TOKENS"]).unwrap()
}

fn dropped_reason(key: &str, value: &str) -> DropReason {
    let f = env::filter([(key, value)], &operator_allowlist());
    assert!(f.kept.is_empty(), "{key:?} kept");
    f.dropped[0].reason
}

fn denied(key: &str, value: &str) {
    assert!(
        matches!(dropped_reason(key, value), DropReason::Denied { .. }),
        "{key}"
    );
}

#[test]
fn env_ld_preload() {
    denied("LD_PRELOAD", "/tmp/evil.so");
    assert!(env::validate_allowlist(["LD_PRELOAD"]).is_err());
}

#[test]
fn env_node_options() {
    denied("NODE_OPTIONS", "--require /tmp/x.js");
    assert!(env::validate_allowlist(["NODE_OPTIONS"]).is_err());
}

cases!(denied {
    env_bash_env: ("BASH_ENV", "/tmp/x.sh");
    env_git_dir: ("GIT_DIR", "/srv/repos/other");
    env_gateway_reroute: ("ANTHROPIC_BASE_URL", "x"), ("ANTHROPIC_API_KEY", "x"),
        ("https_proxy", "x"), ("PATH", "x"), ("HOME", "x");
});

#[test]
fn env_git_config_parameters() {
    let err =
        env::validate_allowlist(["MAX_THINKING_TOKENS", "GIT_CONFIG_PARAMETERS"]).unwrap_err();
    assert!(err.to_string().contains("GIT_CONFIG_PARAMETERS"), "{err}");
    denied("GIT_CONFIG_PARAMETERS", "'core.fsmonitor=touch /tmp/x'");
}

#[test]
fn env_nul_in_value() {
    assert_eq!(
        dropped_reason("MAX_THINKING_TOKENS", "1\0LD_PRELOAD=/x"),
        DropReason::NulInValue
    );
}

#[test]
fn env_huge_value() {
    let huge = "9".repeat(env::DEFAULT_MAX_VALUE_BYTES + 1);
    assert!(matches!(
        dropped_reason("MAX_THINKING_TOKENS", &huge),
        DropReason::ValueTooLong { .. }
    ));
}

#[test]
fn env_total_bound() {
    let a = Allowlist::new(["A", "B"]).unwrap().with_limits(Limits {
        max_value_bytes: 1000,
        max_total_bytes: 1000,
    });
    let f = env::filter([("A", "x".repeat(600)), ("B", "y".repeat(600))], &a);
    assert_eq!(f.kept.len(), 1);
    assert!(matches!(
        f.dropped[0].reason,
        DropReason::TotalTooLarge { .. }
    ));
}

#[test]
fn env_key_with_equals() {
    assert_eq!(dropped_reason("A=B", "c"), DropReason::InvalidName);
    assert!(env::validate_allowlist(["A=B"]).is_err());
}

#[test]
fn env_allowlisted_key_kept() {
    let input = BTreeMap::from([("MAX_THINKING_TOKENS".to_owned(), "2048".to_owned())]);
    let f = env::filter(&input, &operator_allowlist());
    assert_eq!(f.kept, input);
    assert!(f.dropped.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Request paths

fn repo_roots() -> Vec<path::RootPath> {
    vec![path::validate_root("/srv/repos").unwrap()]
}

fn path_reason(s: &str) -> PathReason {
    match RequestPath::parse(s) {
        Err(e) => e.reason,
        Ok(p) => {
            p.within(&repo_roots(), EqualsRoot::Refuse)
                .unwrap_err()
                .reason
        }
    }
}

fn path_refused(s: &str, want: PathReason) {
    assert_eq!(path_reason(s), want, "{s:?}");
}

cases!(path_refused {
    path_sibling_with_common_prefix: ("/srv/repos2", PathReason::NotInRoots),
        ("/srv/repos2/proj", PathReason::NotInRoots);
    path_dotdot_escape: ("/srv/repos/../etc", PathReason::DotDotComponent);
    path_dot_component: ("/srv/repos/./x", PathReason::DotComponent);
    path_double_slash: ("/srv//repos", PathReason::EmptyComponent);
    path_trailing_slash: ("/srv/repos/x/", PathReason::TrailingSlash);
    path_relative: ("srv/repos/x", PathReason::NotAbsolute), ("x", PathReason::NotAbsolute);
    path_root_itself: ("/srv/repos", PathReason::IsRoot);
    path_nul_and_newline: ("/srv/repos/x\0y", PathReason::Nul),
        ("/srv/repos/x\ny", PathReason::ControlChar);
    path_outside_all_roots: ("/etc/passwd", PathReason::NotInRoots), ("/", PathReason::NotInRoots);
});

#[test]
fn path_inside_root_resolves_end_to_end() {
    // The string check hands its relative part to the resolver; a symlink planted inside the
    // accepted path is still refused on disk.
    let tmp = tempfile::tempdir().unwrap();
    let root_str = tmp.path().to_str().unwrap().to_owned();
    let roots = vec![path::validate_root(&root_str).unwrap()];
    mkdirs(tmp.path(), &["proj/.git", "real"]);
    symlink("real", tmp.path().join("linked")).unwrap();
    let root = Root::open(roots[0].as_path()).unwrap();
    let ok = RequestPath::parse(&format!("{root_str}/proj")).unwrap();
    let w = ok.within(&roots, EqualsRoot::Refuse).unwrap();
    root.resolve_dir(&w.rel).unwrap();
    let bad = RequestPath::parse(&format!("{root_str}/linked")).unwrap();
    let w = bad.within(&roots, EqualsRoot::Refuse).unwrap();
    assert_symlink(root.resolve_dir(&w.rel));
}
