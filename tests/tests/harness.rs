//! Tests of the test harness itself: timeouts kill the whole process group and keep the output,
//! services are stopped with everything they started, and the SSE parser keeps event names.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::{Duration, Instant};

use agentbox_tests::harness::{HarnessError, Service, parse_sse, run_captured, wait_group_gone};
use rustix::process::{Pid, test_kill_process_group};

fn group_alive(pgid: u32) -> bool {
    test_kill_process_group(Pid::from_raw(i32::try_from(pgid).unwrap()).unwrap()).is_ok()
}

#[tokio::test]
async fn run_captured_kills_the_group_on_timeout_and_keeps_output() {
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("grandchild.pid");
    let mut cmd = tokio::process::Command::new("sh");
    cmd.arg("-c").arg(format!(
        "echo started; echo oops >&2; sleep 30 & echo $! > {}; wait",
        pidfile.display()
    ));
    let t = Instant::now();
    let err = run_captured("sleeper", cmd, Duration::from_millis(500))
        .await
        .unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(10));
    let HarnessError::Timeout { stdout, stderr, .. } = &err else {
        panic!("expected a timeout, got {err}");
    };
    assert_eq!(stdout, "started\n");
    assert_eq!(stderr, "oops\n");
    // The grandchild shares the shell's group, whose id is the shell's pid.
    let stat = std::fs::read_to_string(&pidfile).unwrap();
    let grandchild: u32 = stat.trim().parse().unwrap();
    let pgid: u32 = std::fs::read_to_string(format!("/proc/{grandchild}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(") ")
                .and_then(|(_, r)| r.split(' ').nth(2)?.parse().ok())
        })
        .unwrap_or(0);
    let left = if pgid == 0 {
        Vec::new()
    } else {
        wait_group_gone(pgid, Duration::from_secs(5))
    };
    assert!(
        left.is_empty(),
        "the background sleep survived the timeout: {left:?}"
    );
}

#[tokio::test]
async fn run_captured_reports_exit_status_and_output() {
    let mut cmd = tokio::process::Command::new("sh");
    cmd.arg("-c").arg("printf 'a\\nb\\n'; exit 3");
    let out = run_captured("sh", cmd, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(out.stdout, "a\nb\n");
}

#[test]
fn service_waits_for_its_ready_line_and_stops_its_group() {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg("echo noise; sleep 0.2; echo 'ready at 127.0.0.1:9'; sleep 30 & wait");
    let (mut svc, addr) = Service::start("sh", cmd, Duration::from_secs(10), |l| {
        l.strip_prefix("ready at ").map(str::to_owned)
    })
    .unwrap();
    assert_eq!(addr, "127.0.0.1:9");
    let pgid = svc.pid();
    assert!(group_alive(pgid));
    svc.stop();
    assert!(svc.stdout().contains("noise"));
    let members = wait_group_gone(pgid, Duration::from_secs(5));
    assert!(
        members.is_empty(),
        "live members of group {pgid}: {members:?}"
    );
}

#[test]
fn service_that_exits_early_reports_its_stderr() {
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg("echo 'bad config' >&2; exit 2");
    let err = Service::start("sh", cmd, Duration::from_secs(10), |_| None).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("bad config") && msg.contains("before printing"),
        "{msg}"
    );
}

#[test]
fn parse_sse_keeps_event_names_and_joins_data_lines() {
    let frames = parse_sse(
        "event: message_start\ndata: {\"a\":1}\n\n: comment\n\ndata: x\r\ndata: y\r\n\r\ndata: [DONE]\n\n",
    );
    assert_eq!(frames.len(), 3);
    assert_eq!(frames[0].event.as_deref(), Some("message_start"));
    assert_eq!(frames[0].data, "{\"a\":1}");
    assert_eq!(frames[1].event, None);
    assert_eq!(frames[1].data, "x\ny");
    assert_eq!(frames[2].data, "[DONE]");
}
