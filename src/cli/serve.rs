//! `selfspec serve`: the OpenAI-compatible server.
use std::net::{IpAddr, SocketAddr};

use anyhow::{bail, Result};
use clap::Args;
use selfspec::serve::{serve, ServeConfig};
use selfspec::spec::plan::{Plan, DEFAULT_TREE};

use crate::cli::args::{DrafterArgs, ModelArgs};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    drafter: DrafterArgs,
    /// The tree each request drafts (as `generate --tree`); `auto` trees are cut per step for
    /// the whole batch by this device's measured costs, so they shrink as load grows.
    #[arg(long, default_value = DEFAULT_TREE, requires = "drafter", help_heading = "Drafter")]
    tree: String,
    /// Draft at every batch size. By default the server measures, per number of sequences
    /// decoding together, whether drafting is faster than plain batched decoding, and drafts
    /// only where it is.
    #[arg(long, help_heading = "Drafter")]
    always_draft: bool,
    /// Address to listen on. The default takes connections from this machine only.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0: any free port; the one chosen is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// The name clients give as `model` [default: the model file's name without extension].
    #[arg(long)]
    model_name: Option<String>,
    /// Requests decoded side by side at most; more wait in the queue.
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Requests waiting at most; past it new ones get 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Largest request body in bytes (larger: 413).
    #[arg(long, default_value_t = 1 << 20)]
    max_body: usize,
    /// MiB of finished requests' KV caches kept, so a prompt that starts as an earlier one did
    /// (a chat's next turn, a shared system prompt) runs only its new tokens; on the CPU answers
    /// are the same bits either way. 0 turns it off; a request's `"cache_prompt": false` opts out.
    #[arg(long, default_value_t = 512, value_name = "MIB")]
    prompt_cache: usize,
    /// Require `Authorization: Bearer KEY` on /v1/* and /metrics (or set SELFSPEC_API_KEY).
    #[arg(long, env = "SELFSPEC_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
}

pub fn run(a: ServeArgs) -> Result<()> {
    if a.max_batch == 0 || a.max_batch > 256 {
        bail!("--max-batch must be between 1 and 256, got {}", a.max_batch);
    }
    if a.queue == 0 || a.queue > 100_000 {
        bail!("--queue must be between 1 and 100000, got {}", a.queue);
    }
    if a.max_body < 1024 {
        bail!("--max-body must be at least 1024 bytes, got {}", a.max_body);
    }
    if a.prompt_cache > 1 << 20 {
        bail!("--prompt-cache is in MiB and at most 1048576 (1 TiB), got {}", a.prompt_cache);
    }
    if a.api_key.as_deref().is_some_and(str::is_empty) {
        bail!("--api-key is empty");
    }
    let plan = Plan::parse(&a.tree)?;
    let model_name = match a.model_name.clone() {
        Some(n) => n,
        None => a.model.model.file_stem().map_or_else(|| "model".to_string(), |s| s.to_string_lossy().into_owned()),
    };
    let (target, drafter, datastore) = a.drafter.load_with(&a.model, "chat requests")?;
    let cfg = ServeConfig {
        addr: SocketAddr::new(a.host, a.port),
        model_name: model_name.clone(),
        plan,
        always_draft: a.always_draft,
        max_batch: a.max_batch,
        queue: a.queue,
        body_limit: a.max_body,
        api_key: a.api_key.clone(),
        drafter_path: a.drafter.drafter.as_ref().map(|p| p.display().to_string()),
        prompt_cache: a.prompt_cache << 20,
    };
    serve(target, drafter, datastore, cfg, |addr| {
        eprintln!("serving '{model_name}' at http://{addr}/ (OpenAI API under /v1; Ctrl-C stops)");
    })?;
    eprintln!("stopped");
    Ok(())
}
