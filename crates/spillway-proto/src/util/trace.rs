//! Trace context across the component boundaries: W3C
//! `traceparent`/`tracestate` in the `trace_context` field of a `Publish`
//! command or `Deliver` event (the gateway↔engine stream batches many
//! messages, so the context travels per message), and in gRPC metadata on
//! the engine's storage writes.
//!
//! The message-path spans are at TRACE level under [`TARGET`]: the log
//! filter leaves them disabled, and only the OpenTelemetry layer (installed
//! when `telemetry.otlp_endpoint` is set) enables them. Every function here
//! first checks whether the span is disabled, so without an exporter no
//! context is serialised and the `trace_context` fields stay empty.

use std::collections::HashMap;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
pub use opentelemetry::trace::SpanContext;
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The `tracing` target of the message-path spans.
pub const TARGET: &str = "spillway::trace";

/// Whether the message-path spans are enabled at all (an OpenTelemetry
/// layer is installed): without one, a level check against the filter's
/// maximum, so the per-message calls below cost next to nothing.
pub fn exported() -> bool {
    tracing::enabled!(target: TARGET, tracing::Level::TRACE)
}

/// W3C trace context as carried in a message.
pub type Carrier = HashMap<String, String>;

/// The W3C context of `span`; empty when the span is disabled (no
/// exporter) or has no valid context.
pub fn carrier(span: &Span) -> Carrier {
    let mut carrier = Carrier::new();
    if !span.is_disabled() {
        TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    }
    carrier
}

/// Makes the context in `carrier` the parent of `span` (which must not have
/// been entered yet). Does nothing when either is empty.
pub fn set_parent(span: &Span, carrier: &Carrier) {
    if span.is_disabled() || carrier.is_empty() {
        return;
    }
    let context = TraceContextPropagator::new().extract(carrier);
    if context.span().span_context().is_valid() {
        let _ = span.set_parent(context);
    }
}

/// The span context of the current span, to link to or parent on later;
/// `None` when it is disabled.
pub fn current() -> Option<SpanContext> {
    if !exported() {
        return None;
    }
    let span = Span::current();
    if span.is_disabled() {
        return None;
    }
    let context = span.context();
    let span_context = context.span().span_context().clone();
    span_context.is_valid().then_some(span_context)
}

/// Whether work started now belongs to a trace: inside an enabled span, or
/// under a remote parent ([`with_remote_parent`]). Spans that only make
/// sense as part of a trace (a storage write) open only then, rather than
/// as a root trace of their own for every untraced write.
pub fn in_trace() -> bool {
    exported()
        && (!Span::current().is_disabled() || opentelemetry::Context::current().has_active_span())
}

/// The span context in `carrier`, if it holds a valid one.
pub fn span_context(carrier: &Carrier) -> Option<SpanContext> {
    if carrier.is_empty() {
        return None;
    }
    let context = TraceContextPropagator::new().extract(carrier);
    let span_context = context.span().span_context().clone();
    span_context.is_valid().then_some(span_context)
}

/// Parents `span` on `parent` and links it to every context in `links`: a
/// storage batch holds many publishes, so it joins the first one's trace
/// and links the rest.
pub fn set_parent_and_links(span: &Span, parent: &SpanContext, links: &[SpanContext]) {
    if span.is_disabled() {
        return;
    }
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(parent.clone()));
    for link in links {
        span.add_link(link.clone());
    }
}

/// Adds the current span's context to outgoing gRPC metadata.
pub(crate) fn inject_metadata(metadata: &mut tonic::metadata::MetadataMap) {
    let span = Span::current();
    if span.is_disabled() {
        return;
    }
    TraceContextPropagator::new().inject_context(&span.context(), &mut MetadataInjector(metadata));
}

/// Runs `work` with the context in incoming gRPC metadata, if any, as the
/// current OpenTelemetry context: spans it opens without a parent span of
/// their own join the caller's trace.
pub async fn with_remote_parent<F: std::future::Future>(
    metadata: &tonic::metadata::MetadataMap,
    work: F,
) -> F::Output {
    use opentelemetry::context::FutureExt;
    if metadata.get("traceparent").is_none() {
        return work.await;
    }
    let context = TraceContextPropagator::new().extract(&MetadataExtractor(metadata));
    if !context.span().span_context().is_valid() {
        return work.await;
    }
    work.with_context(context).await
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value),
        ) {
            self.0.insert(key, value);
        }
    }
}

struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|key| match key {
                tonic::metadata::KeyRef::Ascii(key) => Some(key.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}
