//! The git helpers end to end against the real launcher and real git: snapshot → agent (in
//! the real sandbox, planting hooks and config) → collect → deliver → delete-branch, with
//! hostile repository and workspace configuration that must never run (attack catalogue §10
//! items 24-30).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use agentbox_tests::harness::launcher::{
    self as common, Launcher, Options, SERVICE_UID, chown_tree,
};
use serde_json::json;

/// git as root for test setup and inspection; the test's own git (the operator) must not trip
/// the hostile filters either.
fn git(dir: &Path, args: &[&str]) -> String {
    common::git_with(
        dir,
        &[
            "safe.directory=*",
            "user.name=t",
            "user.email=t@t",
            "core.hooksPath=/dev/null",
            "core.fsmonitor=false",
            "init.defaultBranch=main",
            "filter.evil.smudge=cat",
            "filter.evil.clean=cat",
        ],
        args,
    )
}

/// A launcher, a sentinel directory every identity may write into (a hook that ran would
/// leave a file there) and a [`hostile_repo`] whose code would write into it.
fn hostile_launcher() -> (Launcher, PathBuf, PathBuf) {
    let l = Launcher::start(Options::default());
    let sentinel = l.base.join("sentinels");
    std::fs::create_dir_all(&sentinel).unwrap();
    std::fs::set_permissions(&sentinel, std::fs::Permissions::from_mode(0o777)).unwrap();
    let repo = hostile_repo(&l, &sentinel);
    (l, sentinel, repo)
}

fn hook(dir: &Path, name: &str, sentinel: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let p = dir.join(name);
    std::fs::write(
        &p,
        format!("#!/bin/sh\ntouch {}/{name}\n", sentinel.display()),
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

const HOOKS: &[&str] = &[
    "pre-commit",
    "post-commit",
    "post-checkout",
    "reference-transaction",
    "pre-push",
    "post-merge",
    "pre-receive",
    "post-receive",
    "update",
    "post-update",
    "fsmonitor-watchman",
    "push-to-checkout",
];

/// A repository owned by the service uid whose own config and hooks try to run code.
fn hostile_repo(l: &Launcher, sentinel: &Path) -> PathBuf {
    let repo = l.repos.join("proj");
    std::fs::create_dir_all(repo.join("sub")).unwrap();
    git(&repo, &["init", "-q"]);
    std::fs::write(repo.join("README"), "original\n").unwrap();
    std::fs::write(repo.join("sub/keep"), "k\n").unwrap();
    std::fs::write(repo.join(".gitattributes"), "* filter=evil diff=evil\n").unwrap();
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-q", "-m", "base"]);
    let s = sentinel.display();
    for (k, v) in [
        ("core.fsmonitor", format!("touch {s}/repo-fsmonitor; false")),
        (
            "filter.evil.smudge",
            format!("sh -c 'touch {s}/repo-smudge; cat'"),
        ),
        (
            "filter.evil.clean",
            format!("sh -c 'touch {s}/repo-clean; cat'"),
        ),
        ("diff.evil.command", format!("touch {s}/repo-diff")),
        ("core.sshCommand", format!("touch {s}/repo-ssh")),
        (
            "uploadpack.packObjectsHook",
            format!("touch {s}/repo-packhook;"),
        ),
        ("core.pager", format!("touch {s}/repo-pager")),
    ] {
        git(&repo, &["config", k, &v]);
    }
    for h in HOOKS {
        hook(&repo.join(".git/hooks"), &format!("repo-{h}"), sentinel);
        std::fs::rename(
            repo.join(".git/hooks").join(format!("repo-{h}")),
            repo.join(".git/hooks").join(h),
        )
        .unwrap();
    }
    chown_tree(&repo, SERVICE_UID);
    repo
}

fn inodes(dir: &Path) -> BTreeSet<(u64, u64)> {
    let mut out = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else {
                out.insert((m.dev(), m.ino()));
            }
        }
    }
    out
}

/// No hook, filter or fsmonitor left its mark in `dir`.
fn assert_nothing_ran(dir: &Path) {
    let left = sentinels(dir);
    assert!(left.is_empty(), "code ran: {left:?}");
}

fn sentinels(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn snapshot_collect_deliver_delete_without_running_anything() {
    let (l, sentinel, repo) = hostile_launcher();
    let head = git(&repo, &["rev-parse", "HEAD"]);

    let r = l.post(
        "/repo/snapshot",
        &json!({"tid": "g1", "path": repo.join("sub")}),
    );
    assert_eq!(r.status, 200, "{}\n{}", r.raw, l.stderr());
    assert_eq!(r.body["repo"], repo.display().to_string());
    assert_eq!(r.body["sha"], head);
    let task = l.data.join("tasks/g1");
    let (shadow, ws) = (task.join("shadow.git"), task.join("workspace"));
    assert_eq!(
        std::fs::read_to_string(ws.join("README")).unwrap(),
        "original\n"
    );
    assert_eq!(common::owner_of(&ws), SERVICE_UID);
    // No shared inodes and no alternates: the copies are independent of the repository.
    let repo_objects = inodes(&repo.join(".git/objects"));
    assert!(repo_objects.is_disjoint(&inodes(&shadow.join("objects"))));
    assert!(repo_objects.is_disjoint(&inodes(&ws.join(".git/objects"))));
    assert!(!shadow.join("objects/info/alternates").exists());
    assert!(!ws.join(".git/objects/info/alternates").exists());
    assert_nothing_ran(&sentinel);
    let again = l.post("/repo/snapshot", &json!({"tid": "g1", "path": repo}));
    assert_eq!(
        (again.status, again.code()),
        (409, "conflict"),
        "{}",
        again.raw
    );

    // The agent edits files and plants hooks and config everywhere git might look.
    let s = sentinel.display();
    let mut script = String::from(
        "set -e; cd /workspace; echo changed > README; echo new > added.txt; rm sub/keep; mkdir -p .git/hooks; ",
    );
    for h in HOOKS {
        script.push_str(&format!(
            "printf '#!/bin/sh\\ntouch {s}/ws-{h}\\n' > .git/hooks/{h}; chmod +x .git/hooks/{h}; "
        ));
    }
    script.push_str(&format!(
        "git config core.fsmonitor 'touch {s}/ws-fsmonitor; false'; git config filter.evil.clean 'touch {s}/ws-clean'; \
         git config core.hooksPath /workspace/.git/hooks; \
         mkdir -p vendor/x && git -C vendor/x init -q && printf '#!/bin/sh\\ntouch {s}/nested\\n' > vendor/x/.git/hooks/post-checkout; \
         chmod +x vendor/x/.git/hooks/post-checkout; git -C vendor/x config core.fsmonitor 'touch {s}/nested-fsmonitor'; \
         echo done"
    ));
    let _gw = l.gateway_socket("g1");
    let r = l.post(
        "/agents",
        &json!({"tid": "g1", "model": "m1", "cmd": ["claude", script], "timeout_s": 120}),
    );
    assert_eq!(r.status, 201, "{}", r.raw);
    let v = l.get("/agents/g1?wait=1").body;
    assert_eq!(v["exit_code"], 0, "{v}");
    assert!(v["error"].is_null(), "{v}");
    let commit = v["result_commit"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
        .to_owned();
    assert_eq!(git(&shadow, &["rev-parse", "refs/heads/agent/g1"]), commit);
    assert_eq!(git(&shadow, &["rev-parse", &format!("{commit}^")]), head);
    let files = git(&shadow, &["ls-tree", "-r", "--name-only", &commit]);
    assert!(
        files.contains("added.txt") && !files.contains("sub/keep"),
        "{files}"
    );
    assert!(
        !files.contains("vendor"),
        "nested repositories are left out: {files}"
    );
    assert!(!files.contains(".git/"), "{files}");
    assert_eq!(
        git(&shadow, &["show", &format!("{commit}:README")]),
        "changed"
    );

    // Deliver exactly agent/g1; the repository's HEAD and work tree stay as they were.
    for bad in [
        "agent/other",
        "main",
        "refs/heads/agent/g1",
        "+agent/g1",
        "--upload-pack=touch /tmp/x",
    ] {
        let r = l.post(
            "/repo/deliver",
            &json!({"tid": "g1", "path": repo, "branch": bad}),
        );
        assert_eq!(
            (r.status, r.code()),
            (400, "invalid_branch"),
            "{bad}: {}",
            r.raw
        );
    }
    let r = l.post(
        "/repo/deliver",
        &json!({"tid": "g1", "path": repo, "branch": "agent/g1"}),
    );
    assert_eq!(r.status, 200, "{}", r.raw);
    assert_eq!(r.body["sha"], commit);
    assert_eq!(git(&repo, &["rev-parse", "refs/heads/agent/g1"]), commit);
    assert_eq!(git(&repo, &["symbolic-ref", "HEAD"]), "refs/heads/main");
    assert_eq!(git(&repo, &["rev-parse", "HEAD"]), head);
    assert_eq!(
        std::fs::read_to_string(repo.join("README")).unwrap(),
        "original\n"
    );

    // delete-branch deletes agent branches only, and not one that is checked out.
    for bad in [
        "main",
        "HEAD",
        "refs/heads/main",
        "agent/",
        "agent/x:refs/heads/main",
    ] {
        let r = l.post("/repo/delete-branch", &json!({"path": repo, "branch": bad}));
        assert_eq!(
            (r.status, r.code()),
            (400, "invalid_branch"),
            "{bad}: {}",
            r.raw
        );
    }
    git(&repo, &["branch", "agent/co"]);
    let wt = l.repos.join("wt");
    git(
        &repo,
        &["worktree", "add", "-q", wt.to_str().unwrap(), "agent/co"],
    );
    chown_tree(&repo, SERVICE_UID);
    chown_tree(&wt, SERVICE_UID);
    let r = l.post(
        "/repo/delete-branch",
        &json!({"path": repo, "branch": "agent/co"}),
    );
    assert_eq!((r.status, r.code()), (409, "conflict"), "{}", r.raw);
    let r = l.post(
        "/repo/delete-branch",
        &json!({"path": repo, "branch": "agent/g1"}),
    );
    assert_eq!(r.status, 200, "{}", r.raw);
    assert_eq!(r.body["sha"], commit);
    let refs = git(&repo, &["for-each-ref", "--format=%(refname)"]);
    assert_eq!(refs, "refs/heads/agent/co\nrefs/heads/main", "{refs}");
    let r = l.post(
        "/repo/delete-branch",
        &json!({"path": repo, "branch": "agent/g1"}),
    );
    assert_eq!((r.status, r.code()), (404, "not_found"), "{}", r.raw);

    assert_nothing_ran(&sentinel);
}

/// An agent that changes nothing leaves the snapshot itself as its result, not an empty
/// commit on it: nothing looks done that was not.
#[test]
fn a_run_that_changed_nothing_leaves_the_snapshot() {
    let (l, _sentinel, repo) = hostile_launcher();
    let head = git(&repo, &["rev-parse", "HEAD"]);
    let r = l.post("/repo/snapshot", &json!({"tid": "g0", "path": repo}));
    assert_eq!(r.status, 200, "{}\n{}", r.raw, l.stderr());
    let _gw = l.gateway_socket("g0");
    let r = l.post(
        "/agents",
        &json!({"tid": "g0", "model": "m1", "cmd": ["claude", "cat /workspace/README"], "timeout_s": 120}),
    );
    assert_eq!(r.status, 201, "{}", r.raw);
    let v = l.get("/agents/g0?wait=1").body;
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(v["result_commit"], head, "{v}");
    let shadow = l.data.join("tasks/g0/shadow.git");
    assert_eq!(git(&shadow, &["rev-parse", "refs/heads/agent/g0"]), head);
}

#[test]
fn snapshot_refusals() {
    let (l, sentinel, repo) = hostile_launcher();
    let post = |body: serde_json::Value| l.post("/repo/snapshot", &body);
    for bad in [
        "--upload-pack=touch /tmp/x",
        "HEAD;id",
        "a..b",
        "main:x",
        "HEAD@{1}",
        "",
    ] {
        let r = post(json!({"tid": "s1", "path": repo, "ref": bad}));
        assert_eq!(
            (r.status, r.code()),
            (400, "invalid_ref"),
            "{bad}: {}",
            r.raw
        );
    }
    let r = post(json!({"tid": "s1", "path": repo, "ref": "no-such-branch"}));
    assert_eq!(r.code(), "invalid_ref", "{}", r.raw);
    let r = post(json!({"tid": "s1", "path": "/etc"}));
    assert_eq!(r.code(), "invalid_path", "{}", r.raw);
    let r = post(json!({"tid": "s1", "path": format!("{}/../proj", l.repos.display())}));
    assert_eq!(r.code(), "invalid_path", "{}", r.raw);
    let r = post(json!({"tid": "s1", "path": format!("{}/", repo.display())}));
    assert_eq!(r.code(), "invalid_path", "{}", r.raw);
    let r = post(json!({"tid": "s1", "path": l.repos.join("missing")}));
    assert_eq!((r.status, r.code()), (404, "not_found"), "{}", r.raw);
    assert!(!l.repos.join("missing").exists());
    std::os::unix::fs::symlink(&repo, l.repos.join("link")).unwrap();
    let r = post(json!({"tid": "s1", "path": l.repos.join("link/sub")}));
    assert_eq!(r.code(), "unsafe_path", "{}", r.raw);
    let rootrepo = l.repos.join("rootowned");
    std::fs::create_dir_all(&rootrepo).unwrap();
    git(&rootrepo, &["init", "-q"]);
    let r = post(json!({"tid": "s1", "path": rootrepo}));
    assert_eq!(r.code(), "unsafe_path", "{}", r.raw);
    let r = post(json!({"tid": "S1", "path": repo}));
    assert_eq!(r.code(), "invalid_tid", "{}", r.raw);
    // An older ref works and nothing of the refusals above left a task behind.
    git(
        &repo,
        &[
            "-c",
            "user.name=t",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "second",
        ],
    );
    chown_tree(&repo, SERVICE_UID);
    let first = git(&repo, &["rev-parse", "HEAD~1"]);
    let r = post(json!({"tid": "s1", "path": repo, "ref": "HEAD~1"}));
    assert_eq!(r.status, 200, "{}", r.raw);
    assert_eq!(r.body["sha"], first);
    assert_nothing_ran(&sentinel);
}

/// A linked worktree is followed through its `.git` file only when its git dir and common dir
/// are inside the roots and the service user's; the snapshot is the worktree's HEAD.
#[test]
fn linked_worktrees_are_followed_only_inside_the_roots() {
    let (l, sentinel, repo) = hostile_launcher();
    let wt = l.repos.join("proj-wt");
    git(
        &repo,
        &[
            "worktree",
            "add",
            "-q",
            "-b",
            "feature",
            wt.to_str().unwrap(),
        ],
    );
    std::fs::write(wt.join("FEATURE"), "only on the worktree's branch\n").unwrap();
    git(&wt, &["add", "FEATURE"]);
    git(&wt, &["commit", "-q", "-m", "feature"]);
    chown_tree(&repo, SERVICE_UID);
    chown_tree(&wt, SERVICE_UID);
    let wt_head = git(&wt, &["rev-parse", "HEAD"]);
    assert_ne!(wt_head, git(&repo, &["rev-parse", "HEAD"]));

    let r = l.post("/repo/snapshot", &json!({"tid": "w1", "path": wt}));
    assert_eq!(r.status, 200, "{}", r.raw);
    assert_eq!(
        r.body["sha"], wt_head,
        "the worktree's HEAD, not the main one"
    );
    assert_eq!(r.body["repo"], wt.display().to_string());
    let ws = l.data.join("tasks/w1/workspace");
    assert_eq!(
        std::fs::read_to_string(ws.join("FEATURE")).unwrap(),
        "only on the worktree's branch\n"
    );
    assert_nothing_ran(&sentinel);

    // A .git file pointing outside the roots, or relative, or at a non-worktree: refused.
    let outside = tempfile::tempdir().unwrap();
    for (name, content) in [
        (
            "evil-out",
            format!("gitdir: {}\n", outside.path().display()),
        ),
        (
            "evil-rel",
            "gitdir: ../proj/.git/worktrees/proj-wt\n".to_owned(),
        ),
        (
            "evil-main",
            format!("gitdir: {}\n", repo.join(".git").display()),
        ),
        ("evil-junk", "not a gitdir line\n".to_owned()),
    ] {
        let dir = l.repos.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(".git"), content).unwrap();
        chown_tree(&dir, SERVICE_UID);
        let r = l.post("/repo/snapshot", &json!({"tid": "w2", "path": dir}));
        assert_eq!(r.code(), "unsafe_path", "{name}: {}", r.raw);
    }
    // A worktree whose commondir was redirected outside the roots.
    let wt_git = repo.join(".git/worktrees/proj-wt");
    std::fs::write(
        wt_git.join("commondir"),
        format!("{}\n", outside.path().display()),
    )
    .unwrap();
    let r = l.post("/repo/snapshot", &json!({"tid": "w3", "path": wt}));
    assert_eq!(r.code(), "unsafe_path", "{}", r.raw);
    assert!(!l.data.join("tasks/w3/shadow.git").exists());
    assert_nothing_ran(&sentinel);
}

/// Sends a snapshot request on a thread and waits at most `limit` for the answer: a launcher
/// that blocks on a file must fail the test, not hang it.
fn snapshot_within(
    l: &Launcher,
    tid: &str,
    path: &Path,
    limit: std::time::Duration,
) -> common::Resp {
    let socket = l.data.join("run/launcher.sock");
    let body = json!({"tid": tid, "path": path});
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(common::request(
            &socket,
            "POST",
            "/repo/snapshot",
            Some(&body),
        ));
    });
    rx.recv_timeout(limit)
        .expect("the launcher did not answer: it blocked reading a git file")
}

/// A linked worktree (`<name>/.git` says `gitdir: <repos>/<name>-gd`) whose git dir holds
/// `commondir` as made by `plant`, everything owned by the service uid.
fn planted_worktree(l: &Launcher, name: &str, plant: impl FnOnce(&Path)) -> PathBuf {
    let top = l.repos.join(name);
    let gd = l.repos.join(format!("{name}-gd"));
    std::fs::create_dir_all(&top).unwrap();
    std::fs::create_dir_all(&gd).unwrap();
    std::fs::write(top.join(".git"), format!("gitdir: {}\n", gd.display())).unwrap();
    chown_tree(&top, SERVICE_UID);
    chown_tree(&gd, SERVICE_UID);
    plant(&gd.join("commondir"));
    top
}

/// Issue 9, hole 3: a FIFO where root reads `commondir` must not block the launcher.
#[test]
fn a_fifo_commondir_does_not_hang_the_launcher() {
    let l = Launcher::start(Options::default());
    let top = planted_worktree(&l, "fifo", |commondir| {
        let st = Command::new("mkfifo").arg(commondir).status().unwrap();
        assert!(st.success());
        common::chown(commondir, SERVICE_UID);
    });
    let r = snapshot_within(&l, "f1", &top, std::time::Duration::from_secs(30));
    assert_eq!((r.status, r.code()), (400, "unsafe_path"), "{}", r.raw);
    // And the launcher still serves.
    assert_eq!(l.get("/status").status, 200);
    assert!(!l.data.join("tasks/f1/shadow.git").exists());
}

/// Issue 9, hole 3: a `commondir` symlinked to a root-only file is not read, and no error
/// body carries its content.
#[test]
fn a_symlinked_commondir_is_not_read() {
    let l = Launcher::start(Options::default());
    let marker = "SECRET-MARKER-5d1e0c";
    let secret = l.base.join("secret");
    std::fs::write(&secret, format!("{marker}\n")).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let top = planted_worktree(&l, "sym", |commondir| {
        std::os::unix::fs::symlink(&secret, commondir).unwrap();
    });
    let r = snapshot_within(&l, "s1", &top, std::time::Duration::from_secs(30));
    assert_eq!((r.status, r.code()), (400, "unsafe_path"), "{}", r.raw);
    assert!(!r.raw.contains(marker), "the secret leaked: {}", r.raw);
    assert!(!l.stderr().contains(marker), "the secret reached the log");

    let top = planted_worktree(&l, "shadow", |commondir| {
        std::os::unix::fs::symlink("/etc/shadow", commondir).unwrap();
    });
    let r = snapshot_within(&l, "s2", &top, std::time::Duration::from_secs(30));
    assert_eq!((r.status, r.code()), (400, "unsafe_path"), "{}", r.raw);
    let shadow = std::fs::read_to_string("/etc/shadow").unwrap_or_default();
    for line in shadow.lines().filter(|l| l.len() > 4) {
        assert!(!r.raw.contains(line), "/etc/shadow leaked: {}", r.raw);
    }
    assert!(!r.raw.contains("root:"), "/etc/shadow leaked: {}", r.raw);

    // A regular commondir that is too large, or owned by another uid, is refused unread.
    let top = planted_worktree(&l, "big", |commondir| {
        std::fs::write(commondir, format!("{marker}{}", "x".repeat(10_000))).unwrap();
        common::chown(commondir, SERVICE_UID);
    });
    let r = snapshot_within(&l, "s3", &top, std::time::Duration::from_secs(30));
    assert_eq!((r.status, r.code()), (400, "unsafe_path"), "{}", r.raw);
    assert!(!r.raw.contains(marker), "{}", r.raw);
    let top = planted_worktree(&l, "rootowned", |commondir| {
        std::fs::write(commondir, format!("{marker}\n")).unwrap();
    });
    let r = snapshot_within(&l, "s4", &top, std::time::Duration::from_secs(30));
    assert_eq!((r.status, r.code()), (400, "unsafe_path"), "{}", r.raw);
    assert!(!r.raw.contains(marker), "{}", r.raw);
}
