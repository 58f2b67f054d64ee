//! What the walks of one run cost per workspace entry: the hand-over (scan, then chown to the
//! agent), the watch mode's measurement ([`disk::measure`]) and the hand-back (chown to the
//! service), each on a tree of N 1 KiB files in directories of 100, as the launcher makes them
//! one after the other for every run. Prints a Markdown table of wall time per walk (one thread,
//! so also its CPU) and per entry. Needs root (it chowns); the tree lives under
//! `$AGENTBOX_BENCH_DIR` (default `/var/tmp`), so run it on the data dir's filesystem.
//! `cargo bench -p agentbox-sandbox --bench walk`.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::time::Instant;

use agentbox_sandbox::disk;
use agentbox_sandbox::walk::{self, Owner, WalkLimits};
use rustix::fs::{Mode, OFlags};

const ROUNDS: usize = 30;
const WARM_UP: usize = 3;
const SERVICE: Owner = Owner {
    uid: 64_001,
    gid: 64_001,
};
const AGENT: Owner = Owner {
    uid: 64_002,
    gid: 64_002,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

fn populate(top: &Path, n: usize) -> Result<(), Error> {
    let body = [b'x'; 1024];
    for i in 0..n {
        let dir = top.join(format!("d{}", i / 100));
        if i % 100 == 0 {
            std::fs::create_dir(&dir)?;
            std::os::unix::fs::chown(&dir, Some(SERVICE.uid), Some(SERVICE.gid))?;
        }
        let file = dir.join(format!("f{}", i % 100));
        std::fs::write(&file, body)?;
        std::os::unix::fs::chown(&file, Some(SERVICE.uid), Some(SERVICE.gid))?;
    }
    std::os::unix::fs::chown(top, Some(SERVICE.uid), Some(SERVICE.gid))?;
    Ok(())
}

fn open_top(p: &Path) -> Result<OwnedFd, Error> {
    Ok(rustix::fs::open(
        p,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

fn pct(sorted: &[u128], p: usize) -> f64 {
    let i = (sorted.len().saturating_sub(1) * p) / 100;
    sorted.get(i).copied().unwrap_or(0) as f64 / 1000.0
}

fn main() -> Result<(), Error> {
    if !rustix::process::geteuid().is_root() {
        println!("the walk bench chowns: run it as root");
        return Ok(());
    }
    let base = std::env::var_os("AGENTBOX_BENCH_DIR").unwrap_or_else(|| "/var/tmp".into());
    let limits = WalkLimits::default();
    println!("| files | walk | p50 ms | p90 ms | µs per entry (p50) |");
    println!("|---|---|---|---|---|");
    for n in [2_000_usize, 20_000] {
        let dir = tempfile::tempdir_in(&base)?;
        populate(dir.path(), n)?;
        let top = open_top(dir.path())?;
        let entries = (n + n.div_ceil(100) + 1) as f64;
        let names = ["hand-over", "measure", "hand-back"];
        let mut times: Vec<Vec<u128>> = vec![Vec::new(); names.len()];
        for round in 0..WARM_UP + ROUNDS {
            let mut took = [0_u128; 3];
            let t = Instant::now();
            walk::hand_over(top.as_fd(), AGENT, limits)?;
            took[0] = t.elapsed().as_nanos();
            let t = Instant::now();
            let usage = disk::measure(top.as_fd(), limits)?;
            took[1] = t.elapsed().as_nanos();
            let t = Instant::now();
            let back = walk::hand_back(top.as_fd(), SERVICE, limits)?;
            took[2] = t.elapsed().as_nanos();
            assert_eq!(usage.entries as f64, entries);
            assert_eq!(back.removed, 0);
            if round >= WARM_UP {
                for (k, ns) in took.into_iter().enumerate() {
                    if let Some(v) = times.get_mut(k) {
                        v.push(ns);
                    }
                }
            }
        }
        for (name, mut v) in names.into_iter().zip(times) {
            v.sort_unstable();
            println!(
                "| {n} | {name} | {:.2} | {:.2} | {:.2} |",
                pct(&v, 50) / 1000.0,
                pct(&v, 90) / 1000.0,
                pct(&v, 50) / entries,
            );
        }
    }
    println!(
        "\n{ROUNDS} rounds after {WARM_UP} warm-up; each round hands the tree over, measures it \
         and hands it back, as a run does."
    );
    Ok(())
}
