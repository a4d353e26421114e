//! The `selfspec` binary: sets up the allocator, parses the command line and hands off to
//! [`cli`], which calls the library.
use clap::Parser;

mod cli;

// Training allocates and frees tensors of hundreds of MB each step; mimalloc reuses that memory
// instead of returning it to the kernel and faulting it back in (which cost more than the math).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

// mimalloc's own C API (the library is linked through the `mimalloc` crate; its Rust bindings for
// options sit behind a feature whose dependency is not vendored here).
extern "C" {
    fn mi_option_set(option: std::os::raw::c_int, value: std::os::raw::c_long);
    #[cfg(test)]
    fn mi_option_get(option: std::os::raw::c_int) -> std::os::raw::c_long;
}
/// `mi_option_purge_delay` in mimalloc 2 and 3's `mi_option_e`.
const MI_OPTION_PURGE_DELAY: std::os::raw::c_int = 15;

/// mimalloc hands freed memory back to the kernel a while after its last use (1 s by default in
/// mimalloc 3) and faults it in again when it is reused. Decoding reuses the same buffers every
/// step, yet with the default a 200-token `generate` on native weights still took 12-20k page
/// faults (211k with a 10 ms delay). A CLI run's memory peaks early and stays there, so nothing
/// is handed back: 1.3k faults, and `bench` on native weights ran 3-12% faster at T = 1, 4 and 8
/// (5 interleaved rounds). `MIMALLOC_PURGE_DELAY` in the environment wins.
fn keep_freed_pages_warm() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one integer option; valid at any time, from any thread.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, -1) }
    }
}

fn main() {
    keep_freed_pages_warm();
    let args = cli::Cli::parse();
    if let Some(n) = args.threads {
        // Before any thread pool starts: both the kernels' team and rayon read it once, at first use.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    // Start-up work that repeats per run (the `auto` tree's cost curve) is kept between runs.
    selfspec::draft::budget::cache_costs_in(selfspec::files::cache_dir());
    if let Err(e) = cli::run(args) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The option number is hard-coded from mimalloc's header; a mimalloc that renumbered its
    /// options would make us set some other option. Option 15 must read as the purge delay's
    /// default in mimalloc 3 (1000 ms) before we set it, and as "never" after.
    #[test]
    fn purge_delay_option_is_the_one_we_set() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            return;
        }
        // SAFETY: reads and sets one integer option.
        unsafe {
            assert_eq!(mi_option_get(MI_OPTION_PURGE_DELAY), 1000);
        }
        keep_freed_pages_warm();
        unsafe {
            assert_eq!(mi_option_get(MI_OPTION_PURGE_DELAY), -1);
        }
    }
}
