//! `selfspec serve`: an OpenAI-compatible HTTP server over batched, exact self-speculation.
//!
//! - [`api`]: the request and response shapes, and which parameters are taken or refused.
//! - [`engine`]: the scheduler thread that runs every active request's step in one forward.
//! - [`http`]: axum's routes, streaming, limits, the key, `/metrics` and the page at `/`.
//!
//! A request's tokens are the ones `selfspec generate` gives with the same model, weights,
//! parameters and seed, whatever else is served beside it (see [`engine`] for why).
pub mod api;
pub mod engine;
pub mod http;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::draft::budget::CostCurve;
use crate::draft::datastore::Datastore;
use crate::draft::drafter::Drafter;
use crate::model::loader::Target;
use crate::spec::plan::Plan;
use crate::{Error, Result};

/// Rows the batch's cost curve is measured to (beyond it, cost grows at the last slope).
pub const BATCH_CURVE_ROWS: usize = 64;

/// How to serve.
pub struct ServeConfig {
    pub addr: SocketAddr,
    pub model_name: String,
    /// The tree requests draft; unused without a drafter (decoding is then plain).
    pub plan: Plan,
    /// Draft at every batch size, instead of only where drafting measured faster than not
    /// ([`engine::DraftPolicy`]): for tests and comparisons.
    pub always_draft: bool,
    pub max_batch: usize,
    pub queue: usize,
    pub body_limit: usize,
    pub api_key: Option<String>,
    /// The drafter's directory, for `/v1/models`.
    pub drafter_path: Option<String>,
    /// Bytes of finished requests' KV caches kept for prompts that start the same way (a
    /// chat's next turn, a shared system prompt); 0 keeps none.
    pub prompt_cache: usize,
}

/// Everything the server runs on, built before it listens: the engine started with the tree
/// resolved and, for `auto` trees, the batch's cost curve measured (cached between runs).
pub fn prepare(target: Target, drafter: Option<Drafter>, datastore: Option<Datastore>, cfg: &ServeConfig) -> Result<(Arc<http::AppState>, std::thread::JoinHandle<()>)> {
    let target = Arc::new(target);
    let lookup = cfg.plan.lookup;
    let (tree, costs) = match &drafter {
        Some(d) => {
            d.validate_tree(&cfg.plan.tree)?;
            let tree = d.resolve(&cfg.plan.tree).with_costs(&target.model, lookup.map_or(0, |l| l.max_tokens))?;
            let costs = match &tree {
                crate::draft::choice::TreeChoice::Auto(_) => Some(CostCurve::measure(&target.model, BATCH_CURVE_ROWS)?),
                _ => None,
            };
            (tree, costs)
        }
        None => (cfg.plan.tree.clone(), None),
    };
    let ecfg = engine::EngineConfig { tree, lookup: drafter.as_ref().and(lookup), max_batch: cfg.max_batch, queue: cfg.queue, costs, always_draft: cfg.always_draft, prompt_cache: cfg.prompt_cache };
    let (handle, thread) = engine::start(target.clone(), drafter.map(Arc::new), datastore.map(Arc::new), ecfg)?;
    let state = Arc::new(http::AppState {
        engine: handle,
        target,
        model_name: cfg.model_name.clone(),
        api_key: cfg.api_key.clone(),
        drafter: cfg.drafter_path.clone(),
        queue: cfg.queue,
        started: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        next_id: AtomicU64::new(1),
    });
    Ok((state, thread))
}

/// Listen on `cfg.addr` until SIGINT or SIGTERM; then stop taking connections, let the requests
/// in flight finish, and return once the engine has drained. `on_listening` hears the bound
/// address (port 0 picks a free one).
pub fn serve(target: Target, drafter: Option<Drafter>, datastore: Option<Datastore>, cfg: ServeConfig, on_listening: impl FnOnce(SocketAddr)) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| Error::InvalidArgument(format!("cannot start the async runtime: {e}")))?;
    let (state, engine) = prepare(target, drafter, datastore, &cfg)?;
    let app = http::router(state, cfg.body_limit);
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(cfg.addr).await.map_err(|e| Error::InvalidArgument(format!("cannot listen on {}: {e}", cfg.addr)))?;
        on_listening(listener.local_addr().unwrap_or(cfg.addr));
        axum::serve(listener, app).with_graceful_shutdown(shutdown_signal()).await.map_err(|e| Error::InvalidArgument(format!("server error: {e}")))
    })?;
    // The router (and with it the engine's last handle) is gone: the engine drains and ends.
    engine.join().map_err(|_| Error::InvalidArgument("the engine thread panicked".into()))?;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
