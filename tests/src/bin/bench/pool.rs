//! `bench pool`: rollout slots (`agentbox-pool` over the launcher's slot routes) with the
//! stack of `tests/tests/pool*.rs` (fakellm as the router, gateway, launcher as root, pool),
//! `SLOTS` slots on this host. Figures, one Markdown table on stdout:
//! - generation start → READY: from the pool's socket listening (the pool starts every slot
//!   then: `POST /slots`, then `/health` over the slot's socket) to each slot's first READY;
//! - acquire latency from a warm pool: `POST /acquire` over `pool.sock`, over `cycles`
//!   acquire + release cycles, each acquire made once every slot is READY again;
//! - release → READY: from `POST /release` to that slot READY at the next generation
//!   (teardown, a new gateway task, a new slot started and healthy);
//! - RSS of a ready slot: the sandbox's whole process tree (the launcher's leader pid and its
//!   descendants: bwrap and blackbox-server, idle), and the same slot once opencode is
//!   registered (opencode's server running); slots per GiB is 1024 MiB / that RSS.
//!
//! Must run as root (it starts the real launcher) with `AGENTBOX_CLIENTS_DIR` set.

use std::time::{Duration, Instant};

use agentbox_api::pool::SlotState;
use agentbox_tests::harness::opencode_registration;
use agentbox_tests::harness::pool::{PoolStack, by_traj};
use anyhow::{Context, Result, ensure};
use serde_json::json;

const SLOTS: u16 = 4;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn p50_p99(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| {
        let i = ((v.len() as f64 - 1.0) * q).round() as usize;
        v.get(i).copied().unwrap_or(0.0)
    };
    (at(0.50), at(0.99))
}

/// `pid` and every descendant of it.
fn tree(pid: u32) -> Vec<u32> {
    let mut parent = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // The command may hold spaces and parentheses: the fields follow the last ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|n| n.parse::<u32>().ok());
        if let Some(pp) = ppid {
            parent.push((p, pp));
        }
    }
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let cur = out[i];
        out.extend(parent.iter().filter(|(_, pp)| *pp == cur).map(|(p, _)| *p));
        i += 1;
    }
    out
}

/// (RSS MiB of the tree, its processes' names).
fn tree_rss(pid: u32) -> (f64, Vec<String>) {
    let mut kib = 0;
    let mut names = Vec::new();
    for p in tree(pid) {
        kib += super::rss_kib(p, "VmRSS:");
        if let Ok(c) = std::fs::read_to_string(format!("/proc/{p}/comm")) {
            names.push(c.trim().to_owned());
        }
    }
    (kib as f64 / 1024.0, names)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub async fn bench_pool(quick: bool) -> Result<()> {
    let cycles = if quick { 5 } else { 30 };
    let load_before = loadavg();
    let stack = PoolStack::start(SLOTS, &json!({"rules": [{"text": "ok"}]}));
    let t0 = Instant::now();
    let mut first_ready: Vec<Option<Duration>> = vec![None; usize::from(SLOTS)];
    while first_ready.iter().any(Option::is_none) {
        let s = stack.status().await;
        for v in &s.slots {
            let i = usize::try_from(v.slot_id)?;
            if v.status == SlotState::Ready && first_ready[i].is_none() {
                first_ready[i] = Some(t0.elapsed());
            }
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(600),
            "slots not ready: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let gen_start: Vec<f64> = first_ready.iter().flatten().map(|d| ms(*d)).collect();

    // Idle RSS of one ready slot's sandbox tree.
    let s = stack.status().await;
    let tid = s.slots[0].tid.clone().context("slot 0 has no tid")?;
    let slot = stack.slot(&tid).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    let (idle_rss, idle_names) = tree_rss(slot.pid.context("no pid")?);

    let mut acquire = Vec::new();
    let mut reset = Vec::new();
    for c in 0..cycles {
        stack.until("warm", |s| s.ready == u32::from(SLOTS)).await;
        let t = format!("bench-{c}");
        let a = Instant::now();
        let lease = stack.acquire(&t).await;
        acquire.push(ms(a.elapsed()));
        let r = Instant::now();
        stack
            .client
            .release(&by_traj(&t))
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let (slot_id, old_gen) = (lease.slot_id, lease.generation);
        stack
            .until("reset", |s| {
                s.slots.iter().any(|v| {
                    v.slot_id == slot_id && v.status == SlotState::Ready && v.generation > old_gen
                })
            })
            .await;
        reset.push(ms(r.elapsed()));
    }

    // The same tree with opencode registered (its server running).
    stack.until("warm", |s| s.ready == u32::from(SLOTS)).await;
    let lease = stack.acquire("bench-opencode").await;
    let url = lease.sandbox_url.clone().context("no sandbox_url")?;
    let reg = opencode_registration("http://127.0.0.1:9", "sess-bench-pool", &json!({}));
    let r = reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .build()?
        .post(format!("{url}/v1/rollout/register"))
        .json(&reg)
        .send()
        .await?;
    ensure!(r.status().is_success(), "register: {}", r.text().await?);
    let s = stack.status().await;
    let tid = s
        .slots
        .iter()
        .find(|v| v.slot_id == lease.slot_id)
        .and_then(|v| v.tid.clone())
        .context("no tid")?;
    let slot = stack.slot(&tid).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    // opencode's server settles for a moment after register answers.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (oc_rss, oc_names) = tree_rss(slot.pid.context("no pid")?);
    let load_after = loadavg();

    let (g50, g99) = p50_p99(gen_start.clone());
    let (a50, a99) = p50_p99(acquire);
    let (r50, r99) = p50_p99(reset);
    println!("## Rollout slots ({SLOTS} slots, {cycles} acquire + release cycles)\n");
    println!("| figure | p50 | p99 (max of {SLOTS} for start) |");
    println!("|---|---|---|");
    println!("| pool generation start → READY (ms) | {g50:.0} | {g99:.0} |");
    println!("| acquire from a warm pool (ms) | {a50:.2} | {a99:.2} |");
    println!("| release → slot READY at the next generation (ms) | {r50:.0} | {r99:.0} |");
    println!("\n| ready slot | RSS (MiB) | slots per GiB | processes counted |");
    println!("|---|---|---|---|");
    println!(
        "| idle | {idle_rss:.1} | {:.0} | {} |",
        1024.0 / idle_rss,
        idle_names.join(", ")
    );
    println!(
        "| opencode registered | {oc_rss:.1} | {:.1} | {} |",
        1024.0 / oc_rss,
        oc_names.join(", ")
    );
    println!("\nload average (1/5/15 min): before {load_before}; after {load_after}");
    Ok(())
}
