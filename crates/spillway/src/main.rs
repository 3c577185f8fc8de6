//! `spillway`: starts the broker. Wiring lives in `spillway-serve`; this only
//! parses the command line, sets up logging and waits for a signal.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use spillway_serve::{Role, Settings};
use tracing_subscriber::EnvFilter;

/// jemalloc rather than the system allocator: a backlog that flows to disk
/// frees millions of small payloads in bulk, and glibc's per-thread arenas
/// kept that memory (RSS stayed hundreds of MiB above the budget in
/// `make bench-flow-to-disk`); jemalloc returns it to the system.
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
    /// Exits 0 when the process serving `/healthz` at ADDR is ready (for
    /// container healthchecks: the images carry no curl).
    Healthcheck {
        /// The `host:port` of a process's metrics/health endpoint.
        #[arg(long, default_value = "127.0.0.1:9471")]
        addr: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(RoleArg::Healthcheck { addr }) = &cli.role {
        return healthcheck(addr).await;
    }
    let settings = Settings::load(cli.config.as_deref())?;
    init_logging(&settings);
    let role = match cli.role.clone().unwrap_or(RoleArg::AllInOne) {
        RoleArg::AllInOne | RoleArg::Healthcheck { .. } => Role::AllInOne,
        RoleArg::Gateway => Role::Gateway,
        RoleArg::Engine => Role::Engine,
        RoleArg::Storage => Role::Storage,
        RoleArg::Management => Role::Management,
    };
    let running = spillway_serve::run(role, &settings).await?;
    tracing::info!(?role, addresses = %running.addresses_json(), "spillway ready");
    if let Some(path) = &cli.ready_file {
        write_ready_file(path, &running.addresses_json())?;
    }
    wait_for_signal().await?;
    tracing::info!("shutting down");
    running.shutdown().await;
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
    let status_line = String::from_utf8_lossy(&response);
    let status_line = status_line.lines().next().unwrap_or_default();
    if status_line.split_whitespace().nth(1) == Some("200") {
        return Ok(());
    }
    anyhow::bail!("not ready: {status_line}")
}

fn init_logging(settings: &Settings) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(&settings.telemetry.log_level));
    // Colours only on a terminal: logs in files and `docker logs` stay
    // greppable (`code=BRK-1014`).
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if settings.telemetry.log_format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
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
