//! Stage 3, plan: the ordered tries (targets, fallbacks, context-length skips; see
//! [`crate::routing::plan`]) and the last changes to the forwarded body.

use serde_json::Value;

use super::refusal::Refusal;
use super::values::Admitted;
use crate::routing::{self, Attempt};
use crate::state::Gateway;

pub(crate) fn plan(gw: &Gateway, req: &mut Admitted) -> Result<Vec<Attempt>, Refusal> {
    prepare_body(req);
    let tries = {
        let mut rng = gw.rng.lock();
        routing::plan(&req.resolved, req.model(), req.estimate, &mut *rng)
    };
    if tries.is_empty() {
        return Err(Refusal::ContextTooLong {
            max: req.model().context_length.unwrap_or(0),
            needed: req.estimate,
        });
    }
    Ok(tries)
}

/// The gateway's own changes to the forwarded body.
pub(crate) fn prepare_body(req: &mut Admitted) {
    if req.stream {
        // Ask for the usage chunk so streamed requests are accounted exactly.
        if let Some(obj) = req.body.as_object_mut() {
            let opts = obj
                .entry("stream_options")
                .or_insert_with(|| Value::Object(Default::default()));
            if let Some(o) = opts.as_object_mut() {
                if o.get("include_usage") != Some(&Value::Bool(true)) {
                    o.insert("include_usage".into(), Value::Bool(true));
                    req.rewritten = true;
                }
            }
        }
    }
}
