//! What saving the gateway's state costs per save, the store's way (two slots written in turn
//! in place: one `pwrite`, one `fdatasync`) beside the way it saved before (a temp file
//! created, written and fsynced, renamed into place, the directory fsynced), with the same
//! serialized snapshot of 1, 100 and 1,000 tasks. Prints a Markdown table of wall time and this
//! process's CPU time per save (the kernel's share included; the block layer's own threads
//! not). The files live under `$AGENTBOX_BENCH_DIR` (default `/var/tmp`), so run it on the
//! data dir's filesystem. `cargo bench -p agentbox-gateway --bench store`.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Instant;

use agentbox_gateway::ledger::{Budget, Snapshot, Spent, TaskRecord, TaskState};
use agentbox_gateway::store::{Store, VERSION};

const ROUNDS: usize = 300;
const WARM_UP: usize = 20;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// This process's CPU time (every thread), in ns.
fn cpu_ns() -> u128 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    u128::try_from(t.tv_sec).unwrap_or(0) * 1_000_000_000 + u128::try_from(t.tv_nsec).unwrap_or(0)
}

fn snapshot(tasks: usize) -> Snapshot {
    let mut s = Snapshot {
        version: VERSION,
        ..Snapshot::default()
    };
    for i in 0..tasks {
        s.tasks.insert(
            format!("task-{i:05}"),
            TaskRecord {
                model: "claude-sonnet".into(),
                token_sha256: "ab".repeat(32),
                budget: Budget::default(),
                spent: Spent {
                    input_tokens: 123_456,
                    output_tokens: 7_890,
                    requests: 42,
                    ..Spent::default()
                },
                state: TaskState::Open,
            },
        );
    }
    s
}

/// The save before the slots, as `store.rs` had it.
fn save_by_rename(dir: &Path, snap: &Snapshot) -> Result<(), Error> {
    let bytes = serde_json::to_vec_pretty(snap)?;
    let path = dir.join("gateway.json");
    let tmp = dir.join("gateway.json.tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, &path)?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

/// Wall and CPU ns per save, p50 and mean.
fn measure(mut save: impl FnMut() -> Result<(), Error>) -> Result<(u128, u128, u128), Error> {
    for _ in 0..WARM_UP {
        save()?;
    }
    let mut walls = Vec::with_capacity(ROUNDS);
    let c0 = cpu_ns();
    for _ in 0..ROUNDS {
        let t0 = Instant::now();
        save()?;
        walls.push(t0.elapsed().as_nanos());
    }
    let cpu = (cpu_ns() - c0) / ROUNDS as u128;
    walls.sort_unstable();
    let mean = walls.iter().sum::<u128>() / ROUNDS as u128;
    Ok((walls[ROUNDS / 2], mean, cpu))
}

fn main() -> Result<(), Error> {
    let base = std::env::var_os("AGENTBOX_BENCH_DIR").unwrap_or_else(|| "/var/tmp".into());
    println!(
        "| tasks | JSON bytes | method | wall p50 / mean µs per save | CPU µs per save (this process) |"
    );
    println!("|---|---|---|---|---|");
    for tasks in [1, 100, 1000] {
        let snap = snapshot(tasks);
        let len = serde_json::to_vec_pretty(&snap)?.len();
        // Alternate the two ways, twice each, so neither always meets the warmer disk.
        for round in 0..2 {
            for way in ["temp file + rename (before)", "two slots (now)"] {
                let d = tempfile::Builder::new()
                    .prefix("store-bench-")
                    .tempdir_in(&base)?;
                let (wall, mean, cpu) = if way.starts_with("two") {
                    let (store, _) = Store::open(d.path())?;
                    measure(|| Ok(store.save(&snap)?))?
                } else {
                    let dir = d.path().join("state/gateway");
                    std::fs::create_dir_all(&dir)?;
                    measure(|| save_by_rename(&dir, &snap))?
                };
                println!(
                    "| {tasks} | {len} | {way}{} | {:.0} / {:.0} | {:.0} |",
                    if round == 1 { " (again)" } else { "" },
                    wall as f64 / 1000.0,
                    mean as f64 / 1000.0,
                    cpu as f64 / 1000.0,
                );
            }
        }
    }
    Ok(())
}
