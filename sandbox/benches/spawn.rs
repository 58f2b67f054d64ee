//! What a spawn costs the daemon that makes it: std's `fork` ([`ChildSetup::spawn`]) against
//! `clone(CLONE_VM | CLONE_VFORK)` ([`ChildSetup::spawn_exec`]), each starting `/bin/true`
//! with stdin from `/dev/null` and stdout/stderr piped (as a sandbox start), from a tokio
//! runtime with two workers, in a process holding a heap of 0, 8 or 64 MiB that it writes a byte
//! of every page of after each spawn (a daemon going on with its work: after a `fork`, each
//! first write to a page takes a copy-on-write fault, even once the child has exec'd).
//! "touch only" is that write without a spawn. Methods alternate within each round. Prints a
//! Markdown table. `cargo bench -p agentbox-sandbox --bench spawn`.

use std::path::Path;
use std::process::Stdio;
use std::time::Instant;

use agentbox_sandbox::proc::{ChildSetup, Exec};

const ROUNDS: usize = 400;
const WARM_UP: usize = 20;
const PAGE: usize = 4096;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Method {
    TouchOnly,
    Fork,
    Vfork,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::TouchOnly => "touch only",
            Method::Fork => "fork (`spawn`)",
            Method::Vfork => "clone VM+VFORK (`spawn_exec`)",
        }
    }
}

/// This process's CPU time (every thread), in ns.
fn cpu_ns() -> u128 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    u128::try_from(t.tv_sec).unwrap_or(0) * 1_000_000_000 + u128::try_from(t.tv_nsec).unwrap_or(0)
}

fn touch(heap: &mut [u8]) {
    for i in (0..heap.len()).step_by(PAGE) {
        if let Some(b) = heap.get_mut(i) {
            *b = b.wrapping_add(1);
        }
    }
}

type Error = Box<dyn std::error::Error + Send + Sync>;

async fn once(method: Method, heap: &mut [u8]) -> Result<(u128, u128), Error> {
    let (t0, c0) = (Instant::now(), cpu_ns());
    match method {
        Method::TouchOnly => {}
        Method::Fork => {
            let mut cmd = tokio::process::Command::new("/bin/true");
            cmd.stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let out = ChildSetup::same_identity()
                .spawn(cmd)?
                .wait_with_output()
                .await?;
            assert!(out.status.success());
        }
        Method::Vfork => {
            let out = ChildSetup::same_identity()
                .spawn_exec(Exec::new(Path::new("/bin/true")))?
                .wait_with_output()
                .await?;
            assert!(out.status.success());
        }
    }
    touch(heap);
    Ok((t0.elapsed().as_nanos(), cpu_ns() - c0))
}

fn pct(sorted: &[u128], p: usize) -> f64 {
    let i = (sorted.len().saturating_sub(1) * p) / 100;
    sorted.get(i).copied().unwrap_or(0) as f64 / 1000.0
}

fn main() -> Result<(), Error> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let methods = [Method::TouchOnly, Method::Fork, Method::Vfork];
    println!(
        "| heap written after each spawn | method | wall p50 / p90 µs (spawn, wait, write) | daemon CPU µs per round (mean) | of which the spawn (minus touch only) |"
    );
    println!("|---|---|---|---|---|");
    for mib in [0_usize, 8, 64] {
        let mut heap = vec![1_u8; mib << 20];
        touch(&mut heap);
        let mut walls: Vec<Vec<u128>> = vec![Vec::new(); methods.len()];
        let mut cpus: Vec<u128> = vec![0; methods.len()];
        rt.block_on(async {
            for round in 0..WARM_UP + ROUNDS {
                for (k, &m) in methods.iter().enumerate() {
                    let (wall, cpu) = once(m, &mut heap).await?;
                    if round >= WARM_UP
                        && let (Some(w), Some(c)) = (walls.get_mut(k), cpus.get_mut(k))
                    {
                        w.push(wall);
                        *c += cpu;
                    }
                }
            }
            Ok::<(), Error>(())
        })?;
        let mean = |c: u128| c as f64 / ROUNDS as f64 / 1000.0;
        let touch_cpu = mean(cpus.first().copied().unwrap_or(0));
        for (k, &m) in methods.iter().enumerate() {
            let mut w = walls.get(k).cloned().unwrap_or_default();
            w.sort_unstable();
            let cpu = mean(cpus.get(k).copied().unwrap_or(0));
            let spawn = if m == Method::TouchOnly {
                "—".to_owned()
            } else {
                format!("{:.1}", cpu - touch_cpu)
            };
            println!(
                "| {mib} MiB | {} | {:.1} / {:.1} | {cpu:.1} | {spawn} |",
                m.name(),
                pct(&w, 50),
                pct(&w, 90),
            );
        }
    }
    println!(
        "\n{ROUNDS} rounds after {WARM_UP} warm-up; in each round every method once, in turn. \
         CPU is this process's (`CLOCK_PROCESS_CPUTIME_ID`, all threads), not the child's."
    );
    Ok(())
}
