//! The policy's string rules on arbitrary text: task ids, agent branches, model ids, root,
//! request and relative paths (and placing a request path under roots), env names, the
//! denylist and the env filter, and the presented token. What one rule accepts, the rules
//! built on it accept too, and a parsed value re-parses to itself.
#![no_main]

use agentbox_policy::config::ModelId;
use agentbox_policy::env::{self, Allowlist};
use agentbox_policy::id::{AgentBranch, Tid};
use agentbox_policy::path::{
    EqualsRoot, RelPath, RequestPath, RootPath, validate_component, validate_root,
};
use agentbox_policy::secret::presented_token;
use libfuzzer_sys::fuzz_target;

fuzz_target!(
    |input: (String, Vec<String>, Vec<(String, String)>, Option<Vec<u8>>)| {
        let (s, list, pairs, header) = input;

        if let Ok(tid) = Tid::parse(&s) {
            assert_eq!(Tid::parse(tid.as_str()).as_ref(), Ok(&tid));
            let branch = AgentBranch::for_tid(&tid);
            let back = AgentBranch::parse(&branch.to_string()).expect("own branch name parses");
            assert_eq!(back.tid(), &tid);
            assert!(branch.refname().starts_with("refs/heads/agent/"));
        }
        let _ = AgentBranch::parse(&s);
        if let Ok(m) = ModelId::parse(&s) {
            assert_eq!(
                ModelId::parse(m.as_str()).map(|x| x.as_str().to_owned()),
                Ok(s.clone())
            );
        }

        if let Ok(rel) = RelPath::parse(&s) {
            assert_eq!(RelPath::parse(rel.as_str()).as_ref(), Ok(&rel));
            for c in rel.components() {
                validate_component(c).expect("a component of a valid path is valid");
            }
            for c in &list {
                if validate_component(c).is_ok() {
                    let joined = rel.join(c).expect("a valid component joins");
                    assert_eq!(RelPath::parse(joined.as_str()).as_ref(), Ok(&joined));
                }
            }
        }
        let roots: Vec<RootPath> = list.iter().filter_map(|r| validate_root(r).ok()).collect();
        if let Ok(req) = RequestPath::parse(&s) {
            for eq in [EqualsRoot::Refuse, EqualsRoot::Allow] {
                if let Ok(w) = req.within(&roots, eq) {
                    // The rest of a request path below a root is a relative path by the same rules.
                    let rel = RelPath::parse(w.rel.as_str())
                        .unwrap_or_else(|e| panic!("within() made an invalid RelPath: {e}"));
                    assert_eq!(rel, w.rel);
                    assert!(eq == EqualsRoot::Allow || !w.rel.is_empty());
                }
            }
        }

        if env::valid_name(&s) {
            assert!(s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'));
        }
        let _ = env::denied(&s);
        if let Ok(allow) = Allowlist::new(&list) {
            let f = env::filter(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())), &allow);
            for k in f.kept.keys() {
                assert!(allow.contains(k) && env::valid_name(k) && env::denied(k).is_none());
            }
            assert!(f.kept.len() + f.dropped.len() == pairs.len());
        }

        let h = header.as_deref();
        let _ = presented_token(h, Some(s.as_bytes()));
        let _ = presented_token(None, h);
    }
);
