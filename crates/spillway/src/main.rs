//! `spillway`: starts the broker. Wiring lives in `spillway-serve`; this only
//! parses the command line, sets up logging and waits for a signal.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use spillway_serve::{Role, Settings};
use tracing_subscriber::EnvFilter;

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

#[derive(Subcommand, Clone, Copy)]
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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let settings = Settings::load(cli.config.as_deref())?;
    init_logging(&settings);
    let role = match cli.role.unwrap_or(RoleArg::AllInOne) {
        RoleArg::AllInOne => Role::AllInOne,
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

fn init_logging(settings: &Settings) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(&settings.telemetry.log_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
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
