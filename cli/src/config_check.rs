//! `agentbox config check`: loads `agentbox.toml` exactly as every daemon will and reports the
//! catalogue, so an operator (or systemd's `ExecStartPre`) finds a bad key before a daemon
//! refuses to start.

use std::io::Write;
use std::process::ExitCode;

use agentbox_policy::config::{Backend, Config, HostEnv, config_path};

/// `EX_CONFIG` from sysexits.h: the configuration is wrong, retrying will not help.
const EX_CONFIG: u8 = 78;

/// Checks the config at `cli_path` (else the default), printing text or JSON.
pub fn config_check(cli_path: Option<&std::path::Path>, json: bool, env: &dyn HostEnv) -> ExitCode {
    let path = config_path(cli_path, env);
    let config = match Config::load(&path, env) {
        Ok(c) => c,
        Err(e) => {
            if json {
                let body = serde_json::json!({"ok": false, "path": path, "key": e.key(), "error": e.to_string()});
                println!("{body}");
            } else {
                eprintln!("agentbox: {e}");
            }
            return ExitCode::from(EX_CONFIG);
        }
    };
    let models: Vec<serde_json::Value> = config
        .models
        .values()
        .map(|m| {
            let (backend, detail) = match &m.backend {
                Backend::Vllm { port, .. } => ("vllm", format!("127.0.0.1:{port}")),
                Backend::Ollama { .. } => ("ollama", config.gateway.ollama_url.to_string()),
                Backend::Remote {
                    provider, base_url, ..
                } => ("remote", format!("{} {base_url}", provider.as_str())),
                Backend::Router { base_url, .. } => ("router", base_url.to_string()),
            };
            serde_json::json!({
                "id": m.id, "backend": backend, "upstream_model": m.backend.upstream_model().unwrap_or("(the caller's)"),
                "destination": detail, "cost_budgets": m.prices.is_some(),
            })
        })
        .collect();
    let mut out = std::io::stdout().lock();
    let written = if json {
        let body = serde_json::json!({
            "ok": true, "path": path, "data_dir": config.data_dir,
            "repo_roots": config.launcher.repo_roots, "models": models,
        });
        writeln!(out, "{body}")
    } else {
        let mut text = format!(
            "{}: ok\ndata_dir: {}\nrepo_roots: {}\nmodels: {}\n",
            path.display(),
            config.data_dir.display(),
            config
                .launcher
                .repo_roots
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            models.len()
        );
        for m in &models {
            text.push_str(&format!(
                "  {:<16} {:<7} {} -> {}{}\n",
                m["id"].as_str().unwrap_or_default(),
                m["backend"].as_str().unwrap_or_default(),
                m["upstream_model"].as_str().unwrap_or_default(),
                m["destination"].as_str().unwrap_or_default(),
                if m["cost_budgets"] == true {
                    ""
                } else {
                    " (no prices: token budgets only)"
                },
            ));
        }
        out.write_all(text.as_bytes())
    };
    match written {
        Ok(()) => ExitCode::SUCCESS,
        // A closed stdout (`| head`) is not a configuration problem.
        Err(_) => ExitCode::from(74),
    }
}
