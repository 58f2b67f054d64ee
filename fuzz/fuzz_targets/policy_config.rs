//! `agentbox.toml` from arbitrary text (seeded with the example config): parse and validate
//! never panic, and every model of a valid config is found under its own id.
#![no_main]

use agentbox_policy::config::{Config, FixedEnv};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    let env = FixedEnv {
        vars: [(
            "AGENTBOX_DATA".to_owned(),
            "/var/lib/agentbox-fuzz".to_owned(),
        )]
        .into(),
        euid: 0,
    };
    let Ok(config) = Config::from_toml_str(text, "fuzz.toml", &env) else {
        return;
    };
    for id in config.models.keys() {
        assert!(
            config.model(id.as_str()).is_some(),
            "model {id:?} not found by its id"
        );
    }
});
