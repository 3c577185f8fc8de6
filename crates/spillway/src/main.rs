//! `spillway`: starts the broker. Wiring lives in `spillway-serve`; this only
//! parses the command line, sets up logging and waits for a signal.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use spillway_serve::{Role, Settings};
use tracing::Level;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

mod allocator;

/// jemalloc rather than the system allocator: a backlog that flows to disk
/// frees millions of small payloads in bulk, and glibc's per-thread arenas
/// kept that memory (RSS stayed hundreds of MiB above the budget in
/// `make bench-flow-to-disk`); jemalloc returns it to the system. It also
/// serves `malloc` itself (the `unprefixed` feature), so RocksDB's
/// allocations are returned the same way. `allocator::configure` sets how
/// soon freed pages go back.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    version,
    about = "Spillway: an AMQP 0-9-1 broker that spills to disk instead of falling over"
)]
struct Cli {
    /// Configuration file (default: ./spillway.toml when present).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Once listening, write the bound addresses here as JSON.
    #[arg(long, global = true)]
    ready_file: Option<PathBuf>,
    #[command(subcommand)]
    role: Option<RoleArg>,
}

#[derive(Subcommand, Clone)]
enum RoleArg {
    /// Every component in one process on an embedded store (the default).
    AllInOne,
    /// The AMQP gateway alone, talking to `gateway.engine_addr`.
    Gateway,
    /// The queue engine alone, talking to `engine.storage_addr`.
    Engine,
    /// The storage node alone.
    Storage,
    /// The management API alone.
    Management,
    /// Exits 0 when the process serving `/healthz` at ADDR is ready or a
    /// standby engine, and prints which (`ok`, `standby`); for container
    /// healthchecks: the images carry no curl.
    Healthcheck {
        /// The `host:port` of a process's metrics/health endpoint.
        #[arg(long, default_value = "127.0.0.1:9471")]
        addr: String,
    },
}

/// An expected failure (a port in use, a bad setting, a store held by
/// another engine) is one line on standard error and exit status 1; its
/// causes follow on the same line. No backtrace: the message says what to
/// mend.
fn main() -> std::process::ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the runtime: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(RoleArg::Healthcheck { addr }) = &cli.role {
        return healthcheck(addr).await;
    }
    let settings = Settings::load(cli.config.as_deref())?;
    let (role, service_name) = match cli.role.clone().unwrap_or(RoleArg::AllInOne) {
        RoleArg::AllInOne | RoleArg::Healthcheck { .. } => (Role::AllInOne, "spillway"),
        RoleArg::Gateway => (Role::Gateway, "spillway-gateway"),
        RoleArg::Engine => (Role::Engine, "spillway-engine"),
        RoleArg::Storage => (Role::Storage, "spillway-storage"),
        RoleArg::Management => (Role::Management, "spillway-management"),
    };
    let traces = init_logging(&settings, service_name)?;
    let result = serve(role, &cli, &settings).await;
    if let Some(provider) = traces {
        // Exports what is still batched; blocks, so off the runtime's
        // workers (the exporter's channel runs on them).
        let shutdown = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        if let Ok(Err(error)) = shutdown {
            eprintln!("exporting the last spans failed: {error}");
        }
    }
    result
}

async fn serve(role: Role, cli: &Cli, settings: &Settings) -> anyhow::Result<()> {
    allocator::configure();
    let metrics = spillway_telemetry::Metrics::new();
    allocator::register(&metrics);
    let running = spillway_serve::run_with_metrics(role, settings, metrics).await?;
    tracing::info!(?role, addresses = %running.addresses_json(), "spillway ready");
    if let Some(path) = &cli.ready_file {
        write_ready_file(path, &running.addresses_json())?;
    }
    let stepped_down = tokio::select! {
        signal = wait_for_signal() => {
            signal?;
            None
        }
        reason = running.stepped_down() => Some(reason),
    };
    if let Some(reason) = &stepped_down {
        tracing::error!(
            code = "MST-1101",
            reason = %reason,
            "MST-1101 : Store failure : {reason}: this standby-capable engine stops serving"
        );
    } else {
        tracing::info!("shutting down");
    }
    running.shutdown().await;
    if let Some(reason) = stepped_down {
        anyhow::bail!(
            "the engine lost the store's lease and stepped down ({reason}); restart it to stand by"
        );
    }
    Ok(())
}

/// One HTTP/1.0 GET: enough for a healthcheck, no HTTP client dependency.
async fn healthcheck(addr: &str) -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let check = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(format!("GET /healthz HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        anyhow::Ok(response)
    };
    let response = tokio::time::timeout(std::time::Duration::from_secs(5), check)
        .await
        .context("healthcheck timed out")??;
    let response = String::from_utf8_lossy(&response);
    let status_line = response.lines().next().unwrap_or_default();
    if status_line.split_whitespace().nth(1) == Some("200") {
        // `ok`, or `standby` for a standby engine: scripts tell them apart.
        let state = response
            .rsplit("\r\n\r\n")
            .next()
            .unwrap_or_default()
            .trim();
        println!("{state}");
        return Ok(());
    }
    anyhow::bail!("not ready: {status_line}")
}

/// Logs to stderr and, with `telemetry.otlp_endpoint` set, traces over
/// OTLP: returns the tracer provider to shut down (flush) on exit.
///
/// Each layer has its own filter: the log filter leaves the message-path
/// spans (TRACE, target `spillway::trace`) disabled, and only the
/// OpenTelemetry layer, installed only with an endpoint, enables them. So
/// without one they cost a level check and no context is serialised.
fn init_logging(
    settings: &Settings,
    service_name: &str,
) -> anyhow::Result<Option<SdkTracerProvider>> {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(&settings.telemetry.log_level));
    // Colours only on a terminal: logs in files and `docker logs` stay
    // greppable (`code=BRK-1014`).
    let logs = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let logs = if settings.telemetry.log_format == "json" {
        logs.json().boxed()
    } else {
        logs.boxed()
    };
    let provider = match settings.telemetry.otlp_endpoint() {
        Some(endpoint) => Some(tracer_provider(endpoint, service_name)?),
        None => None,
    };
    let traces = provider.as_ref().map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("spillway"))
            .with_filter(Targets::new().with_target(spillway_serve::TRACE_TARGET, Level::TRACE))
    });
    tracing_subscriber::registry()
        .with(logs.with_filter(filter))
        .with(traces)
        .init();
    Ok(provider)
}

/// Batched OTLP/gRPC export (`OTEL_BSP_*` tune the batching). The service
/// name is the role's unless `OTEL_SERVICE_NAME` says otherwise.
fn tracer_provider(endpoint: &str, service_name: &str) -> anyhow::Result<SdkTracerProvider> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .with_context(|| format!("OTLP exporter for {endpoint}"))?;
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service_name.to_string());
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

/// Written to a temporary name then renamed, so readers never see half a file.
fn write_ready_file(path: &std::path::Path, content: &str) -> anyhow::Result<()> {
    let temporary = path.with_extension("tmp");
    std::fs::write(&temporary, content)
        .with_context(|| format!("writing {}", temporary.display()))?;
    std::fs::rename(&temporary, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

async fn wait_for_signal() -> anyhow::Result<()> {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        result = tokio::signal::ctrl_c() => result?,
        _ = terminate.recv() => {}
    }
    Ok(())
}
