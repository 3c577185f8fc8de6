//! OTLP traces: a real OTLP/gRPC collector runs inside the test;
//! the broker exports to it (`telemetry.otlp_endpoint`); lapin publishes one
//! persistent message to a durable queue and consumes it. The publish, its
//! storage write and its delivery must arrive as one trace: in the separate
//! wiring from the gateway, engine and storage processes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use spillway_integration_tests::{eventually, next_delivery, Sandbox, Wiring};

const QUEUE: &str = "traced";

/// One received span: its process's `service.name`, trace id, name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Received {
    service: String,
    /// Hex.
    trace_id: String,
    name: String,
}

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Received>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|resource| &resource.attributes)
                .find(|attribute| attribute.key == "service.name")
                .and_then(|attribute| attribute.value.as_ref()?.value.as_ref())
                .map(|value| match value {
                    Value::StringValue(name) => name.clone(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    spans.push(Received {
                        service: service.clone(),
                        trace_id: span.trace_id.iter().map(|b| format!("{b:02x}")).collect(),
                        name: span.name,
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

async fn start_collector() -> (SocketAddr, Collector) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let collector = Collector::default();
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(collector.clone()))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    tokio::spawn(server);
    (addr, collector)
}

/// The spans of every process, exported every 100 ms rather than 5 s.
fn short_export_delay() {
    // Both tests set the same value; the children inherit it.
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "100");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_processes_export_one_trace_per_message() {
    short_export_delay();
    let (addr, collector) = start_collector().await;
    let config = format!("[telemetry]\notlp_endpoint = \"http://{addr}\"\n");
    let sandbox = Sandbox::start_with_config(Wiring::Separate, &config)
        .await
        .expect("sandbox starts");
    let expected = [
        ("spillway-gateway", "publish"),
        ("spillway-engine", "publish"),
        ("spillway-engine", "write_batch"),
        ("spillway-storage", "write"),
        ("spillway-engine", "deliver"),
        ("spillway-gateway", "deliver"),
    ];
    let result = tokio::time::timeout(
        Duration::from_secs(60),
        case(&sandbox, &collector, &expected),
    )
    .await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(error)) => panic!("{error:#}\n{}", sandbox.logs()),
        Err(_) => panic!("timed out\n{}", sandbox.logs()),
    }
}

/// In the all-in-one wiring the test process is the broker: it installs the
/// same layer `main` installs, exporting to the collector.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_exports_one_trace_per_message() {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::WithExportConfig as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::Layer as _;

    short_export_delay();
    let (addr, collector) = start_collector().await;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(format!("http://{addr}"))
        .build()
        .unwrap();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name("spillway")
                .build(),
        )
        .build();
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("spillway"))
        .with_filter(
            tracing_subscriber::filter::Targets::new()
                .with_target(spillway_serve::TRACE_TARGET, tracing::Level::TRACE),
        );
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer)).unwrap();

    let sandbox = Sandbox::start(Wiring::InProcess)
        .await
        .expect("sandbox starts");
    let expected = [
        ("spillway", "publish"),
        ("spillway", "write_batch"),
        ("spillway", "write"),
        ("spillway", "deliver"),
    ];
    let result = tokio::time::timeout(
        Duration::from_secs(60),
        case(&sandbox, &collector, &expected),
    )
    .await;
    drop(sandbox);
    let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(error)) => panic!("{error:#}"),
        Err(_) => panic!("timed out"),
    }
}

async fn case(
    sandbox: &Sandbox,
    collector: &Collector,
    expected: &[(&str, &str)],
) -> anyhow::Result<()> {
    let connection = sandbox.connect().await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(
            QUEUE.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let confirm = channel
        .basic_publish(
            "".into(),
            QUEUE.into(),
            BasicPublishOptions::default(),
            b"traced message",
            BasicProperties::default().with_delivery_mode(2),
        )
        .await?
        .await?;
    anyhow::ensure!(confirm.is_ack(), "publish not confirmed: {confirm:?}");
    let mut consumer = channel
        .basic_consume(
            QUEUE.into(),
            "tracer".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let delivery = next_delivery(&mut consumer, Duration::from_secs(10)).await?;
    anyhow::ensure!(delivery.data == b"traced message");
    delivery.ack(BasicAckOptions::default()).await?;

    // One trace holding every expected (process, span) pair.
    eventually(Duration::from_secs(30), || async {
        let spans = collector.spans.lock().unwrap().clone();
        let mut traces: BTreeMap<String, BTreeSet<(String, String)>> = BTreeMap::new();
        for span in &spans {
            traces
                .entry(span.trace_id.clone())
                .or_default()
                .insert((span.service.clone(), span.name.clone()));
        }
        let complete = traces.values().any(|found| {
            expected
                .iter()
                .all(|(service, name)| found.contains(&(service.to_string(), name.to_string())))
        });
        anyhow::ensure!(
            complete,
            "no trace holds all of {expected:?}; received {traces:#?}"
        );
        Ok(())
    })
    .await
}
