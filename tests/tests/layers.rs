//! The layering of ARCHITECTURE.md, enforced: every dependency edge between our own crates
//! must be in the allowed table (arrows point down: programs → engines → ground), and every
//! crate but `agentbox-sandbox` forbids `unsafe` at its root.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use agentbox_tests::harness::cargo;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

/// Crate → the crates of ours it may depend on (normal or dev). Mirrors ARCHITECTURE.md.
const ALLOWED: &[(&str, &[&str])] = &[
    ("agentbox-policy", &[]),
    ("agentbox-wire", &[]),
    ("agentbox-http", &["agentbox-api", "agentbox-policy"]),
    ("agentbox-api", &["agentbox-policy"]),
    (
        "agentbox-llm",
        &["agentbox-http", "agentbox-policy", "agentbox-wire"],
    ),
    ("agentbox-sandbox", &["agentbox-policy"]),
    (
        "agentbox-launcher",
        &[
            "agentbox-api",
            "agentbox-http",
            "agentbox-policy",
            "agentbox-sandbox",
        ],
    ),
    (
        "agentbox-gateway",
        &[
            "agentbox-api",
            "agentbox-http",
            "agentbox-llm",
            "agentbox-policy",
            "agentbox-sandbox",
            "agentbox-wire",
        ],
    ),
    (
        "agentbox-bridge",
        &[
            "agentbox-http",
            "agentbox-llm",
            "agentbox-policy",
            "agentbox-sandbox",
            "agentbox-wire",
        ],
    ),
    (
        "agentbox-blackbox",
        &[
            "agentbox-api",
            "agentbox-http",
            "agentbox-llm",
            "agentbox-policy",
            "agentbox-sandbox",
            "agentbox-wire",
        ],
    ),
    (
        "agentbox-pool",
        &["agentbox-api", "agentbox-http", "agentbox-policy"],
    ),
    // fakellm is a test and demo tool: ground crates only.
    ("agentbox-fakellm", &["agentbox-api"]),
    (
        "agentbox-cli",
        &["agentbox-api", "agentbox-fakellm", "agentbox-policy"],
    ),
    (
        "agentbox-tests",
        &[
            "agentbox-api",
            "agentbox-fakellm",
            "agentbox-http",
            "agentbox-policy",
            "agentbox-sandbox",
            "agentbox-wire",
        ],
    ),
];

fn metadata() -> Value {
    let out = cargo(&[
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
        "--offline",
    ])
    .unwrap_or_else(|e| panic!("{e}"));
    serde_json::from_slice(&out).expect("cargo metadata prints JSON")
}

#[test]
fn dependency_edges_point_down_only() {
    let allowed: BTreeMap<&str, BTreeSet<&str>> = ALLOWED
        .iter()
        .map(|(k, v)| (*k, v.iter().copied().collect()))
        .collect();
    let meta = metadata();
    let packages = meta["packages"].as_array().expect("packages");
    let ours: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let mut bad = Vec::new();
    for p in packages {
        let name = p["name"].as_str().expect("name");
        let Some(ok) = allowed.get(name) else {
            bad.push(format!("{name} is not in the layer table"));
            continue;
        };
        for d in p["dependencies"].as_array().expect("dependencies") {
            let dep = d["name"].as_str().expect("dependency name");
            if ours.contains(dep) && !ok.contains(dep) {
                bad.push(format!("{name} → {dep}"));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "edges outside ARCHITECTURE.md's layers: {bad:?}"
    );
}

#[test]
fn only_the_sandbox_crate_may_use_unsafe() {
    let meta = metadata();
    let mut missing = Vec::new();
    for p in meta["packages"].as_array().expect("packages") {
        let name = p["name"].as_str().expect("name");
        for t in p["targets"].as_array().expect("targets") {
            let kinds: Vec<&str> = t["kind"]
                .as_array()
                .expect("kind")
                .iter()
                .filter_map(Value::as_str)
                .collect();
            // Integration tests, benches and examples are separate roots too, but they are
            // test code; the rule is about what ships.
            if !kinds.iter().any(|k| *k == "lib" || *k == "bin") {
                continue;
            }
            let src = t["src_path"].as_str().expect("src_path");
            let text = std::fs::read_to_string(src).expect("crate root readable");
            let forbids = text.contains("#![forbid(unsafe_code)]");
            if name == "agentbox-sandbox" {
                continue;
            }
            if !forbids {
                missing.push(format!("{name}: {src}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "crate roots without #![forbid(unsafe_code)]: {missing:?}"
    );
}
