//! W3C trace context of the current span, for event headers.

use opentelemetry::trace::TraceContextExt;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The `traceparent` and `tracestate` of a span.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// `00-<trace id>-<span id>-<flags>`.
    pub traceparent: String,
    /// Vendor state, when the span has any.
    pub tracestate: Option<String>,
}

/// The trace context of the current `tracing` span, when an OpenTelemetry layer is installed and
/// the span belongs to a valid trace.
pub fn current_trace_context() -> Option<TraceContext> {
    let cx = tracing::Span::current().context();
    let span = cx.span();
    let sc = span.span_context();
    if !sc.is_valid() {
        return None;
    }
    let state = sc.trace_state().header();
    Some(TraceContext {
        traceparent: format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        ),
        tracestate: (!state.is_empty()).then_some(state),
    })
}
