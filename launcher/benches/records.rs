//! What the run records cost: each run's life in the store (saved when it starts, saved again
//! when it ends, forgotten at `DELETE`), one run at a time and 32 at once, on the disk holding
//! the temp dir (`TMPDIR`, or the directory given as the first argument). Prints a Markdown
//! table. `cargo bench -p agentbox-launcher --bench records [-- DIR]`.

use std::time::Instant;

use agentbox_launcher::state::{Record, StateStore};
use agentbox_launcher::task::{Final, Outcome, RunKind};
use agentbox_policy::id::Tid;

const SEQUENTIAL: usize = 1000;
const AT_ONCE: usize = 32;
const BURSTS: usize = 30;

/// The process's CPU time (user + system, every thread's, exited ones included), in clock
/// ticks of 10 ms: fine for totals over hundreds of runs.
fn cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (tick(11) + tick(12)) / 100.0
}

fn record(tid: &Tid, finished: bool) -> Record {
    Record {
        tid: tid.clone(),
        kind: RunKind::Agent,
        finished: finished.then_some(Final::Exited),
        outcome: Outcome::default(),
        workspace_gid: 7,
        agent_uid: Some(64_003),
    }
}

fn life(store: &StateStore, tid: &str) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let tid = Tid::parse(tid)?;
    store.save(&record(&tid, false))?;
    store.save(&record(&tid, true))?;
    store.remove(&tid)?;
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // `cargo bench` passes `--bench`; a directory is the one argument that is not a flag.
    let base = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .map_or_else(std::env::temp_dir, std::path::PathBuf::from);
    let tmp = tempfile::Builder::new()
        .prefix("records-bench-")
        .tempdir_in(&base)?;
    let store = StateStore::open(&tmp.path().join("state/agents"))?;
    for i in 0..20 {
        life(&store, &format!("warm{i}"))?;
    }

    let (t, c, s) = (Instant::now(), cpu_s(), store.syncs());
    for i in 0..SEQUENTIAL {
        life(&store, &format!("s{i}"))?;
    }
    let seq_wall = t.elapsed().as_secs_f64() * 1000.0 / SEQUENTIAL as f64;
    let seq_cpu = (cpu_s() - c) * 1000.0 / SEQUENTIAL as f64;
    let seq_syncs = (store.syncs() - s) as f64 / SEQUENTIAL as f64;

    let (t, c, s) = (Instant::now(), cpu_s(), store.syncs());
    for round in 0..BURSTS {
        let threads: Vec<_> = (0..AT_ONCE)
            .map(|i| {
                let store = store.clone();
                std::thread::spawn(move || life(&store, &format!("b{round}x{i}")))
            })
            .collect();
        for t in threads {
            t.join().map_err(|_| "a bench thread panicked")??;
        }
    }
    let burst_wall = t.elapsed().as_secs_f64() * 1000.0 / BURSTS as f64;
    let burst_cpu = (cpu_s() - c) * 1000.0 / (BURSTS * AT_ONCE) as f64;
    let burst_syncs = (store.syncs() - s) as f64 / (BURSTS * AT_ONCE) as f64;

    println!(
        "### Run records: save at start, save at end, forget (in {})\n",
        base.display()
    );
    println!("| case | wall ms | CPU ms per run | fdatasyncs per run (2 saves) |");
    println!("|---|---|---|---|");
    println!(
        "| one run at a time ({SEQUENTIAL} runs) | {seq_wall:.3} per run | {seq_cpu:.3} | {seq_syncs:.2} |"
    );
    println!(
        "| {AT_ONCE} runs at once ({BURSTS} bursts) | {burst_wall:.3} per burst | {burst_cpu:.3} | {burst_syncs:.2} |"
    );
    Ok(())
}
