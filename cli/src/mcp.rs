//! `agentbox mcp`: the verbs `run`, `status`, `logs`, `stop`, `check` and `deliver` as the
//! tools of an MCP server on stdin/stdout (the official SDK, `rmcp`), so a supervising agent
//! such as Claude Code can delegate work into sandboxes. Each tool calls the same library
//! function as the CLI verb ([`crate::run`], [`crate::verbs`]) with the same argument type
//! ([`crate::args`], whose doc comments are the schema's descriptions), and answers with the
//! JSON `--json` prints (as `structuredContent` and as text) after a short line for people.
//!
//! Failures are tool results with `isError` (the CLI's one line, exit code and its name), never
//! a protocol error or a crash; `isError` is set exactly when the CLI would exit non-zero. A
//! `run` reports progress notifications when the request carries a `progressToken`, and a
//! `notifications/cancelled` for it stops the task as Ctrl-C does. stdout is the protocol:
//! logs go to stderr. SIGINT/SIGTERM or the client closing stdin stop the server after the
//! runs under way have been stopped and cleaned up.

use std::any::Any;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rmcp::handler::server::common::schema_for_input;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    InitializeResult, ListToolsResult, MetaObject, NotificationMetaObject, PaginatedRequestParams,
    ProgressNotificationParam, ProgressToken, ServerCapabilities, ServerConfig, Tool,
    ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, Peer, RoleServer, ServerHandler, ServiceExt};
use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::args::{CheckArgs, DeliverArgs, LogsArgs, RunArgs, StatusArgs, StopArgs, tid};
use crate::daemons::Daemons;
use crate::error::CliError;
use crate::render;
use crate::run::{self, Event, Progress};
use crate::verbs;

/// How often a run polls for progress (notifications are sent when something changed).
const POLL: Duration = Duration::from_secs(1);
/// A progress notification at least this often while a run goes on, changed or not.
const HEARTBEAT: Duration = Duration::from_secs(10);
/// The largest page `logs` returns.
const LOG_PAGE: usize = 64 * 1024;
/// How long the runs under way get to stop and clean up once the server is told to stop.
const DRAIN: Duration = Duration::from_secs(120);

/// What the server tells the client about itself.
const INSTRUCTIONS: &str = "agentbox runs Claude Code on a snapshot of a git repository in a \
bubblewrap sandbox, with every model call metered and budgeted. `run` blocks until the agent \
ends and delivers its commits as the branch agent/<tid> (progress notifications while it runs; \
cancel the request to stop it). `status`, `logs`, `stop`, `check` and `deliver` act on tasks by \
their id. Errors carry the agentbox CLI's one-line message, exit code and exit_name.";

/// The tools: name, description, input schema, read-only and destructive hints.
fn tools() -> Result<Vec<Tool>, CliError> {
    fn tool<T: JsonSchema + Any>(
        name: &'static str,
        description: &'static str,
        read_only: bool,
        destructive: bool,
    ) -> Result<Tool, CliError> {
        let schema = schema_for_input::<T>().map_err(|reason| CliError::Io {
            what: format!("building the input schema of the {name} tool"),
            reason,
        })?;
        Ok(Tool::new(name, description, schema).with_annotations(
            ToolAnnotations::new()
                .read_only(read_only)
                .destructive(destructive),
        ))
    }
    Ok(vec![
        tool::<RunArgs>(
            "run",
            "Run Claude Code on a snapshot of a git repository in a sandbox, metered and budgeted, \
             and deliver its commits as the branch agent/<tid> (unless keep). Blocks until the \
             agent ends; sends progress notifications (elapsed time, requests, tokens, cost, \
             budget left, the agent's last action) and stops the task cleanly when cancelled. \
             Returns the summary: outcome, branch, commits, diffstat, usage, budget left.",
            false,
            false,
        )?,
        tool::<StatusArgs>(
            "status",
            "The launcher's and gateway's state: tasks with their usage and budget left, runs, \
             vLLM backends, host readiness.",
            true,
            false,
        )?,
        tool::<LogsArgs>(
            "logs",
            "A task's agent output (Claude Code's stream-json lines), a page of at most 64 KiB \
             from offset; call again with next_offset for more.",
            true,
            false,
        )?,
        tool::<StopArgs>(
            "stop",
            "Stop a task: kill its sandbox, hand the workspace back, close its gateway task.",
            false,
            true,
        )?,
        tool::<CheckArgs>(
            "check",
            "Run a command (e.g. the tests) in a sandbox on a task's workspace, without network \
             or model; returns its exit code and output.",
            false,
            false,
        )?,
        tool::<DeliverArgs>(
            "deliver",
            "Bring the branch agent/<tid> into the repository the task was snapshotted from \
             (for a run made with keep).",
            false,
            false,
        )?,
    ])
}

/// Serves MCP on stdin/stdout until the client goes away or SIGINT/SIGTERM.
///
/// # Errors
/// When the tools cannot be described, the signal handlers cannot be installed, or the client
/// never completes the `initialize` handshake.
pub async fn serve(d: Daemons) -> Result<ExitCode, CliError> {
    init_logging();
    let shutdown = crate::interrupt_token()?;
    let server = Server {
        d: Arc::new(d),
        tools: Arc::new(tools()?),
        shutdown: shutdown.clone(),
        tracker: TaskTracker::new(),
    };
    let tracker = server.tracker.clone();
    let running = server
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| CliError::Io {
            what: "the MCP handshake".to_owned(),
            reason: e.to_string(),
        })?;
    let service = running.cancellation_token();
    tokio::spawn(async move {
        shutdown.cancelled().await;
        service.cancel();
    });
    let quit = running.waiting().await;
    tracing::info!(?quit, "MCP client gone; waiting for the runs under way");
    tracker.close();
    if tokio::time::timeout(DRAIN, tracker.wait()).await.is_err() {
        tracing::warn!("runs still stopping after {DRAIN:?}; leaving them to the launcher");
    }
    Ok(ExitCode::SUCCESS)
}

/// Logs to stderr (stdout carries the protocol), filtered by `RUST_LOG` (default `warn`).
fn init_logging() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    // Fails only when a subscriber is already set (a test in this process did it).
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// The MCP server: the daemons' clients, the tools, and the runs under way.
#[derive(Clone)]
struct Server {
    d: Arc<Daemons>,
    tools: Arc<Vec<Tool>>,
    /// Cancelled by SIGINT/SIGTERM: every run stops.
    shutdown: CancellationToken,
    /// Every tool call, so the server exits only after they finished cleaning up.
    tracker: TaskTracker,
}

/// A verb's answer: a short text for people, the JSON `--json` prints, the CLI's exit code.
struct Reply {
    text: String,
    json: serde_json::Value,
    exit_code: u8,
}

impl Reply {
    fn new<T: Serialize>(text: String, value: &T, exit_code: u8) -> Result<Reply, CliError> {
        let json = serde_json::to_value(value).map_err(|e| CliError::Io {
            what: "encoding the result".to_owned(),
            reason: e.to_string(),
        })?;
        Ok(Reply {
            text,
            json,
            exit_code,
        })
    }
}

/// A verb's answer or failure as a tool result: the short text, the JSON as text (clients that
/// read only `content` see it too) and as `structuredContent`; `isError` when the CLI would
/// exit non-zero.
fn tool_result(r: Result<Reply, CliError>) -> CallToolResult {
    let reply = r.unwrap_or_else(|e| Reply {
        text: format!(
            "agentbox: {e} (exit code {} {})",
            e.exit_code(),
            e.exit_name()
        ),
        json: e.to_json(),
        exit_code: e.exit_code(),
    });
    let mut result = CallToolResult::structured(reply.json.clone());
    result.content = vec![
        ContentBlock::text(reply.text),
        ContentBlock::text(reply.json.to_string()),
    ];
    result.is_error = Some(reply.exit_code != 0);
    result
}

/// A tool's arguments; a mismatch is the caller's mistake ([`CliError::Usage`], exit 2).
fn parse<T: DeserializeOwned>(
    tool: &str,
    arguments: Option<rmcp::model::JsonObject>,
) -> Result<T, CliError> {
    let value = serde_json::Value::Object(arguments.unwrap_or_default());
    serde_json::from_value(value)
        .map_err(|e| CliError::Usage(format!("the arguments of the {tool} tool: {e}")))
}

impl Server {
    async fn call(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<Reply, CliError> {
        let d = &*self.d;
        let args = request.arguments;
        match request.name.as_ref() {
            "run" => self.run(parse(&request.name, args)?, context).await,
            "status" => {
                let StatusArgs { json: _ } = parse(&request.name, args)?;
                let report = verbs::status(d).await;
                Ok(Reply {
                    text: render::status_text(&report),
                    json: report.to_json(),
                    exit_code: report.exit_code(),
                })
            }
            "logs" => {
                let a: LogsArgs = parse(&request.name, args)?;
                let page = verbs::logs(d, &tid(&a.tid)?, a.stderr, a.offset, Some(LOG_PAGE), false)
                    .await?;
                let text = format!(
                    "task {} ({}): bytes {}..{} of its {}{}",
                    page.tid,
                    page.state,
                    page.offset,
                    page.next_offset,
                    if a.stderr { "stderr" } else { "output" },
                    if page.done { "" } else { "; the run goes on" }
                );
                Reply::new(text, &page, 0)
            }
            "stop" => {
                let a: StopArgs = parse(&request.name, args)?;
                let stopped = verbs::stop(d, &tid(&a.tid)?).await?;
                Reply::new(render::stopped_text(&stopped), &stopped, 0)
            }
            "check" => {
                let a: CheckArgs = parse(&request.name, args)?;
                let c = verbs::check(d, &tid(&a.tid)?, a.timeout, a.venv, &a.command).await?;
                let text = format!(
                    "exit code {}{}",
                    c.exit_code,
                    c.problem
                        .as_deref()
                        .map_or_else(String::new, |p| format!(": {p}"))
                );
                Reply::new(text, &c, c.exit_code)
            }
            "deliver" => {
                let a: DeliverArgs = parse(&request.name, args)?;
                let r = verbs::deliver(d, &tid(&a.tid)?, &a.repo).await?;
                Reply::new(render::delivered_text(&r), &r, 0)
            }
            other => Err(CliError::Usage(format!(
                "no tool {other:?}; the tools are run, status, logs, stop, check and deliver"
            ))),
        }
    }

    /// The `run` tool: [`run::run`] with progress as notifications, stopped when the request
    /// is cancelled or the server told to stop.
    async fn run(
        &self,
        args: RunArgs,
        context: RequestContext<RoleServer>,
    ) -> Result<Reply, CliError> {
        let opts = args.options(POLL)?;
        let cancel = self.shutdown.child_token();
        let request = context.ct.clone();
        let stop = cancel.clone();
        let watcher = tokio::spawn(async move {
            tokio::select! {
                () = request.cancelled() => stop.cancel(),
                () = stop.cancelled() => {}
            }
        });
        let (summary, sent) = match context.meta.get_progress_token() {
            Some(token) => {
                let (tx, rx) = mpsc::unbounded_channel();
                let sender = tokio::spawn(forward(context.peer.clone(), rx));
                let mut progress = Notifier::new(token, tx);
                let summary = run::run(&self.d, &opts, &mut progress, &cancel).await;
                drop(progress);
                // Every notification goes out before the result does.
                (summary, sender.await.ok())
            }
            None => (
                run::run(&self.d, &opts, &mut run::Silent, &cancel).await,
                None,
            ),
        };
        cancel.cancel();
        let _ = watcher.await;
        let summary = summary?;
        tracing::debug!(tid = summary.tid, ?sent, "run ended");
        let mut text = render::summary_text(&summary);
        if let Some(advice) = summary.outcome.advice() {
            text.push_str(&format!("agentbox: {advice}\n"));
        }
        Reply::new(text, &summary, summary.outcome.exit_code())
    }
}

/// Sends the progress notifications in order; how many went out.
async fn forward(
    peer: Peer<RoleServer>,
    mut rx: mpsc::UnboundedReceiver<ProgressNotificationParam>,
) -> usize {
    let mut sent = 0;
    while let Some(p) = rx.recv().await {
        if peer.notify_progress(p).await.is_err() {
            break;
        }
        sent += 1;
    }
    sent
}

/// A run's events as progress notifications: `progress` is the elapsed seconds (it increases
/// with every notification, as the spec wants), `message` the line the terminal shows, and
/// `_meta["agentbox/progress"]` the numbers of a poll. A poll that changed nothing is sent
/// only as a heartbeat.
struct Notifier {
    token: ProgressToken,
    tx: mpsc::UnboundedSender<ProgressNotificationParam>,
    started: Instant,
    last_progress: f64,
    last_tick: Option<(String, Instant)>,
}

impl Notifier {
    fn new(token: ProgressToken, tx: mpsc::UnboundedSender<ProgressNotificationParam>) -> Self {
        Notifier {
            token,
            tx,
            started: Instant::now(),
            last_progress: 0.0,
            last_tick: None,
        }
    }
}

impl Progress for Notifier {
    fn event(&mut self, event: &Event<'_>) {
        let mut meta = None;
        if let Event::Tick(tick) = event {
            let line = render::tick_line(tick);
            if let Some((last, at)) = &self.last_tick
                && *last == line
                && at.elapsed() < HEARTBEAT
            {
                return;
            }
            self.last_tick = Some((line, Instant::now()));
            let usage = tick.task.as_ref().map(|t| &t.usage);
            let numbers = serde_json::json!({
                "elapsed_s": tick.elapsed.as_secs_f64(),
                "state": tick.state,
                "requests": usage.map(|u| u.requests),
                "total_tokens": usage.map(|u| u.total_tokens),
                "cost_usd": usage.map(|u| u.cost_usd),
                "budget": tick.task.as_ref().map(|t| t.budget),
                "remaining": tick.task.as_ref().map(|t| &t.remaining),
                "last_action": tick.last_action,
            });
            let mut object = rmcp::model::JsonObject::new();
            object.insert("agentbox/progress".to_owned(), numbers);
            meta = Some(NotificationMetaObject(MetaObject(object)));
        }
        // Milliseconds, and never the same value twice.
        let elapsed = self.started.elapsed().as_millis() as f64 / 1000.0;
        let progress = elapsed.max(self.last_progress + 0.001);
        self.last_progress = progress;
        let mut p = ProgressNotificationParam::new(self.token.clone(), progress)
            .with_message(render::event_line(event));
        p.meta = meta;
        // The receiver is gone only once the client is: nothing left to tell.
        let _ = self.tx.send(p);
    }
}

impl ServerHandler for Server {
    fn get_info(&self) -> ServerConfig {
        InitializeResult::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("agentbox", env!("CARGO_PKG_VERSION")))
            .with_instructions(INSTRUCTIONS)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult::with_all_items(self.tools.as_ref().clone()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let reply = self.tracker.track_future(self.call(request, context)).await;
        Ok(tool_result(reply).into())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn every_tool_has_an_object_schema_with_the_cli_arguments() {
        let tools = tools().unwrap();
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
        assert_eq!(names, ["run", "status", "logs", "stop", "check", "deliver"]);
        let run = &tools[0].input_schema;
        assert_eq!(run["type"], "object");
        let props = run["properties"].as_object().unwrap();
        for key in [
            "repo",
            "model",
            "prompt",
            "budget_tokens",
            "budget_usd",
            "timeout",
            "keep",
            "ref",
        ] {
            assert!(props.contains_key(key), "run lacks {key}: {run:?}");
        }
        assert!(!props.contains_key("json"), "--json is the terminal's");
        let required: Vec<&str> = run["required"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert_eq!(required, ["repo", "model", "prompt"]);
        assert!(
            !tools[2].input_schema["properties"]
                .as_object()
                .unwrap()
                .contains_key("follow")
        );
    }

    #[test]
    fn bad_arguments_are_usage_errors() {
        let mut args = rmcp::model::JsonObject::new();
        args.insert("repo".to_owned(), serde_json::json!(7));
        let e = parse::<RunArgs>("run", Some(args)).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let r = tool_result(Err(e));
        assert_eq!(r.is_error, Some(true));
        let json = r.structured_content.unwrap();
        assert_eq!(json["exit_name"], "usage");
        assert!(json["error"].as_str().unwrap().contains("run tool"));
    }
}
