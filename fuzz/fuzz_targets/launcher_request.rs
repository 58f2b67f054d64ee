//! The launcher API's request bodies in process: each shape parsed from arbitrary JSON, then the
//! checks `launcher.rs` runs before touching anything (task id, model, argv, env allowlist,
//! timeout, token, stdin, check command, repo path under the roots, git revision, agent branch),
//! against the example config. What passes keeps the properties the sandbox relies on.
#![no_main]

use agentbox_api::launcher::{
    AgentRequest, CheckRequest, DeleteBranchRequest, DeliverRequest, SnapshotRequest,
};
use agentbox_fuzz::example_config;
use agentbox_launcher::git::validate_ref;
use agentbox_launcher::validate;
use agentbox_policy::id::AgentBranch;
use agentbox_policy::path::{EqualsRoot, RequestPath};
use libfuzzer_sys::fuzz_target;

fn repo_path(path: &str) {
    let roots = &example_config().launcher.repo_roots;
    if let Ok(req) = RequestPath::parse(path) {
        let _ = req.within(roots, EqualsRoot::Refuse);
    }
}

fn branch(tid: &str, branch: &str) {
    if let Ok(b) = AgentBranch::parse(branch) {
        assert_eq!(
            b.to_string(),
            branch,
            "a branch is accepted only as written"
        );
        let _ = validate::tid(tid).map(|t| &t == b.tid());
    }
}

fuzz_target!(|input: (u8, &[u8])| {
    let (which, bytes) = input;
    let config = example_config();
    let limits = &config.launcher.limits;
    match which % 5 {
        0 => {
            let Ok(r) = serde_json::from_slice::<AgentRequest>(bytes) else {
                return;
            };
            let _ = validate::tid(&r.tid);
            let _ = validate::model(config, &r.model);
            if let Ok(args) = validate::cmd(&r.cmd) {
                assert_eq!(r.cmd.first().map(String::as_str), Some("claude"));
                assert!(args.iter().all(|a| !a.contains('\0')));
            }
            if let Ok(env) = validate::env(config, &r.env) {
                assert_eq!(env, r.env, "an accepted env is passed whole");
            }
            let _ = validate::timeout(r.timeout_s, limits.max_agent_timeout_s);
            if let Ok(Some(t)) = validate::token(r.token.as_deref()) {
                assert!(t.expose().bytes().all(|b| b.is_ascii_graphic()));
            }
            let _ = validate::stdin(r.stdin.as_deref());
        }
        1 => {
            let Ok(r) = serde_json::from_slice::<CheckRequest>(bytes) else {
                return;
            };
            let _ = validate::tid(&r.tid);
            if validate::command(&r.command).is_ok() {
                assert!(!r.command.contains('\0'));
            }
            let _ = validate::timeout(r.timeout_s, limits.max_check_timeout_s);
        }
        2 => {
            let Ok(r) = serde_json::from_slice::<SnapshotRequest>(bytes) else {
                return;
            };
            let _ = validate::tid(&r.tid);
            repo_path(&r.path);
            if let Some(spec) = &r.git_ref
                && validate_ref(spec).is_ok()
            {
                assert!(!spec.starts_with('-') && !spec.contains("..") && !spec.contains(':'));
            }
        }
        3 => {
            let Ok(r) = serde_json::from_slice::<DeliverRequest>(bytes) else {
                return;
            };
            repo_path(&r.path);
            branch(&r.tid, &r.branch);
        }
        _ => {
            let Ok(r) = serde_json::from_slice::<DeleteBranchRequest>(bytes) else {
                return;
            };
            repo_path(&r.path);
            let _ = AgentBranch::parse(&r.branch);
        }
    }
});
