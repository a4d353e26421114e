//! Writing files so that a kill never leaves half of one behind; reading them within bounds; the
//! on-disk cache of start-up work.
use std::path::PathBuf;

use crate::{Error, Result};

/// Atomic write: write to a sibling temporary file, then rename over the target, so an
/// interrupted run never leaves a half-written checkpoint or report behind.
pub fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
    Ok(())
}

/// Where start-up work that would otherwise repeat on every run is kept between runs (the `auto`
/// tree's measured cost curve, datastore indexes): `$SELFSPEC_CACHE` (`off` for no cache), else
/// `$XDG_CACHE_HOME/selfspec`, else `~/.cache/selfspec`; `None` when off or there is no home.
pub fn cache_dir() -> Option<PathBuf> {
    match std::env::var_os("SELFSPEC_CACHE") {
        Some(v) if v == "off" => None,
        Some(v) if !v.is_empty() => Some(PathBuf::from(v)),
        _ => std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(|v| PathBuf::from(v).join("selfspec"))
            .or_else(|| std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".cache/selfspec"))),
    }
}

/// The cache entry `kind/key` under `dir`, when present and at most `max` bytes. A cache is an
/// optimisation: anything unreadable is a miss, and every reader checks what it gets.
pub fn cache_read(dir: &std::path::Path, kind: &str, key: &str, max: u64) -> Option<Vec<u8>> {
    read_bounded(&dir.join(kind).join(key), max, "a cache entry").ok()
}

/// Store the cache entry `kind/key` under `dir` atomically. Failures are ignored (a read-only
/// home must not stop a run): the next run measures again.
pub fn cache_write(dir: &std::path::Path, kind: &str, key: &str, bytes: &[u8]) {
    let _ = write_atomic(&dir.join(kind).join(key), bytes);
}

/// Which build of the program is running: the size and modification time of its executable.
/// Cached measurements of the kernels (the `auto` tree's cost curve) are keyed by it, since
/// they change between builds of one version: a curve measured before the AVX-512 attention
/// for 256-wide heads made Gemma-3-270M's trees 1.2 nodes where 2.4 paid. Cheap (one `stat`),
/// unlike hashing the executable; empty where the executable cannot be found.
pub fn build_identity() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        let meta = std::env::current_exe().and_then(std::fs::metadata);
        match meta {
            Ok(m) => {
                let t = m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
                format!("{}-{t}", m.len())
            }
            Err(_) => String::new(),
        }
    })
}

/// A cache key: the hex SHA-256 of `parts`, each length-prefixed so no two lists collide.
pub fn cache_key(parts: &[&[u8]]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The largest JSON/text configuration file read whole (drafter configs, tree files, a model's
/// config.json and tokenizer_config.json): they describe, they do not hold weights.
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;

/// Read a configuration file whole, after checking it is no larger than [`MAX_CONFIG_BYTES`].
pub fn read_config(path: &std::path::Path) -> Result<String> {
    read_text(path, MAX_CONFIG_BYTES, "a configuration file")
}

/// Read a small text file whole, after checking its size against `max` (so a huge or hostile
/// file is refused before it is read); `what` names the kind of file in the message.
pub fn read_text(path: &std::path::Path, max: u64, what: &str) -> Result<String> {
    let bytes = read_bounded(path, max, &format!("{what} is read whole only up to {max} bytes"))?;
    String::from_utf8(bytes).map_err(|_| Error::bad_file(path, "not UTF-8 text"))
}

/// Most bytes read from something that is not a regular file (a pipe, `/dev/stdin`, a device),
/// whose size is unknown until it has been read: `/dev/zero` as a prompts file read until memory
/// ran out.
pub const MAX_STREAM_BYTES: u64 = 256 << 20;

/// Read `path` whole, refusing more than `max` bytes (`why` says why, in the message): a regular
/// file by its size before reading, anything else (a pipe, a device) by reading at most `max`
/// (and [`MAX_STREAM_BYTES`]) plus one byte.
pub fn read_bounded(path: &std::path::Path, max: u64, why: &str) -> Result<Vec<u8>> {
    use std::io::Read;
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_dir() {
        return Err(Error::bad_file(path, "a directory, not a file"));
    }
    let (max, why) = if meta.is_file() {
        if meta.len() > max {
            return Err(Error::bad_file(path, format!("{} bytes; {why}", meta.len())));
        }
        (max, why.to_string())
    } else if max > MAX_STREAM_BYTES {
        (MAX_STREAM_BYTES, "not a regular file (a pipe or a device), which is read only up to that".to_string())
    } else {
        (max, why.to_string())
    };
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut bytes = Vec::new();
    f.take(max.saturating_add(1)).read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > max {
        return Err(Error::bad_file(path, format!("more than {max} bytes; {why}")));
    }
    Ok(bytes)
}

/// This machine's available memory in bytes (`MemAvailable`), where the OS says.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

/// Read a data file whole (prompts, a corpus file), failing with a message instead of an abort
/// when it could not fit: text is held several times over while it is tokenized, so a file
/// larger than a quarter of the available memory is refused before it is read.
pub fn read_data(path: &std::path::Path) -> Result<Vec<u8>> {
    match available_memory() {
        Some(avail) => read_bounded(path, avail / 4, &format!("more than a quarter of this machine's {:.1} GB of available memory; split it into smaller files", avail as f64 / 1e9)),
        None => read_bounded(path, u64::MAX, "too large to read"),
    }
}

/// A drafter's (safetensors) weights file read whole, each float tensor checked finite ([`check_finite`]).
pub fn load_weights(path: &std::path::Path) -> Result<std::collections::HashMap<String, candle_core::Tensor>> {
    let ts = candle_core::safetensors::load(path, &candle_core::Device::Cpu).map_err(|e| Error::bad_file(path, format!("not a readable safetensors file: {e}")))?;
    check_finite(&ts, path)?;
    Ok(ts)
}

/// Refuse weights holding NaN or an infinity, naming the tensor. Why: a training run with an
/// infinite learning rate wrote a drafter whose weights were all NaN, and it loaded and drafted
/// nothing, without a word (verification kept the output right, so nothing else showed it).
pub fn check_finite(ts: &std::collections::HashMap<String, candle_core::Tensor>, path: &std::path::Path) -> Result<()> {
    let mut names: Vec<&String> = ts.keys().collect();
    names.sort();
    for name in names {
        let t = &ts[name];
        if !t.dtype().is_float() {
            continue;
        }
        // A million values at a time: a full-vocabulary head is 28 M values, and a whole f32
        // copy of it would add 113 MB to the load's peak for a check.
        const CHUNK: usize = 1 << 20;
        let flat = t.flatten_all()?;
        let n = flat.elem_count();
        for start in (0..n).step_by(CHUNK) {
            let v = flat.narrow(0, start, CHUNK.min(n - start))?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
            if let Some(x) = v.iter().find(|x| !x.is_finite()) {
                return Err(Error::bad_file(path, format!("tensor {name} holds {x}: not usable weights (from a training run that diverged?)")));
            }
        }
    }
    Ok(())
}

/// Write tensors as a safetensors file atomically (sibling temporary file, then rename), with an
/// optional header entry. Written through [`write_atomic`], so the file gets the usual
/// umask-respecting mode (0644 under the common umask; candle's writer made weight files 0600
/// while the JSON beside them was 0644).
pub fn save_safetensors(tensors: &std::collections::HashMap<String, candle_core::Tensor>, meta: Option<(&str, &str)>, path: &std::path::Path) -> Result<()> {
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let views = names.into_iter().map(|n| Ok((n.as_str(), HostTensor::of(&tensors[n])?))).collect::<Result<Vec<_>>>()?;
    let header = meta.map(|(k, v)| std::collections::HashMap::from([(k.to_string(), v.to_string())]));
    let bytes = safetensors::serialize(views, header).map_err(|e| Error::bad_file(path, format!("cannot serialise tensors: {e}")))?;
    write_atomic(path, &bytes)
}

/// [`save_safetensors`] with boolean tensors beside the others (candle has no boolean type;
/// EAGLE-3 checkpoints carry one, `t2d`).
pub fn save_safetensors_with_bools(tensors: &std::collections::HashMap<String, candle_core::Tensor>, bools: &[(&str, &[bool])], path: &std::path::Path) -> Result<()> {
    let mut views: Vec<(String, HostTensor)> = Vec::new();
    for (n, t) in tensors {
        views.push((n.clone(), HostTensor::of(t)?));
    }
    for (n, b) in bools {
        views.push((n.to_string(), HostTensor { dtype: safetensors::Dtype::BOOL, shape: vec![b.len()], data: b.iter().map(|&x| x as u8).collect() }));
    }
    views.sort_by(|a, b| a.0.cmp(&b.0));
    let bytes = safetensors::serialize(views, None).map_err(|e| Error::bad_file(path, format!("cannot serialise tensors: {e}")))?;
    write_atomic(path, &bytes)
}

/// A tensor's bytes on the host in safetensors' little-endian layout (candle implements the
/// `View` trait only for its own, older safetensors version).
struct HostTensor {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl HostTensor {
    fn of(t: &candle_core::Tensor) -> Result<Self> {
        use candle_core::DType;
        let flat = t.flatten_all()?;
        let (dtype, data): (safetensors::Dtype, Vec<u8>) = match t.dtype() {
            DType::F32 => (safetensors::Dtype::F32, flat.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
            DType::F16 => (safetensors::Dtype::F16, flat.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
            DType::BF16 => (safetensors::Dtype::BF16, flat.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
            DType::U32 => (safetensors::Dtype::U32, flat.to_vec1::<u32>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
            DType::U8 => (safetensors::Dtype::U8, flat.to_vec1::<u8>()?),
            DType::I64 => (safetensors::Dtype::I64, flat.to_vec1::<i64>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
            other => return Err(Error::InvalidArgument(format!("cannot store a {other:?} tensor in safetensors here"))),
        };
        Ok(HostTensor { dtype, shape: t.dims().to_vec(), data })
    }
}

impl safetensors::View for HostTensor {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Fail now, before any work, if `path` could not be written later: its folder is created if
/// missing, and a probe file is created in it and removed. Why: `eval`, `tune` and `train` used to
/// find a read-only output folder only after minutes of work.
pub fn check_writable(path: &std::path::Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if path.is_dir() {
        return Err(Error::bad_file(path, "is a directory; expected a file to write"));
    }
    probe_dir(&dir).map_err(|e| Error::io(path, std::io::Error::new(e.kind(), format!("cannot be written: {e}"))))
}

/// As [`check_writable`] for an output folder: a file can be made in it. A folder this check
/// had to create is removed again, so a run that fails later leaves nothing behind.
pub fn check_writable_dir(dir: &std::path::Path) -> Result<()> {
    if dir.exists() && !dir.is_dir() {
        return Err(Error::bad_file(dir, "exists and is not a directory"));
    }
    let existed = dir.exists();
    probe_dir(dir).map_err(|e| Error::io(dir, std::io::Error::new(e.kind(), format!("cannot be written: {e}"))))?;
    if !existed {
        let _ = std::fs::remove_dir(dir);
    }
    Ok(())
}

fn probe_dir(dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(format!(".selfspec-probe-{}.tmp", std::process::id()));
    std::fs::write(&probe, b"")?;
    std::fs::remove_file(&probe)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The build identity names this executable: its size, then its modification time.
    #[test]
    fn build_identity_is_the_executables_size_and_time() {
        let id = build_identity();
        let len = std::fs::metadata(std::env::current_exe().unwrap()).unwrap().len();
        let (size, time) = id.split_once('-').expect("size-time");
        assert_eq!(size.parse::<u64>().unwrap(), len);
        assert!(time.parse::<u128>().unwrap() > 0);
        assert_eq!(build_identity(), id);
    }

    /// A file over the bound is refused by its size; a stream (`/dev/zero`, which never ends)
    /// is read no further than the bound plus a byte; a directory is named as one.
    #[test]
    fn bounded_reads_refuse_what_is_too_large_even_without_a_size() {
        let dir = std::env::temp_dir().join(format!("selfspec-bounded-{}", std::process::id()));
        let p = dir.join("t.txt");
        write_atomic(&p, b"hello").unwrap();
        assert_eq!(read_bounded(&p, 5, "test").unwrap(), b"hello");
        assert!(read_bounded(&p, 4, "test").unwrap_err().to_string().contains("5 bytes"));
        let zero = std::path::Path::new("/dev/zero");
        if zero.exists() {
            let e = read_bounded(zero, 1 << 20, "test").unwrap_err().to_string();
            assert!(e.contains("/dev/zero") && e.contains("more than 1048576 bytes"), "{e}");
            assert!(read_text(zero, 1 << 20, "a tree file").is_err());
        }
        assert!(read_bounded(&dir, 100, "test").unwrap_err().to_string().contains("directory"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Weights with a NaN or an infinity are refused, the tensor named; finite ones load.
    #[test]
    fn drafter_weights_must_be_finite() {
        let dir = std::env::temp_dir().join(format!("selfspec-finite-{}", std::process::id()));
        let p = dir.join("w.safetensors");
        let dev = candle_core::Device::Cpu;
        let good = candle_core::Tensor::new(&[1.0f32, -2.0], &dev).unwrap();
        let ids = candle_core::Tensor::new(&[7u32, 9], &dev).unwrap();
        let ts = std::collections::HashMap::from([("a".to_string(), good.clone()), ("ids".to_string(), ids)]);
        save_safetensors(&ts, None, &p).unwrap();
        assert_eq!(load_weights(&p).unwrap().len(), 2);
        for bad in [f32::NAN, f32::INFINITY] {
            let t = candle_core::Tensor::new(&[1.0f32, bad], &dev).unwrap().to_dtype(candle_core::DType::F16).unwrap();
            let ts = std::collections::HashMap::from([("a".to_string(), good.clone()), ("b.weight".to_string(), t)]);
            save_safetensors(&ts, None, &p).unwrap();
            let e = load_weights(&p).unwrap_err().to_string();
            assert!(e.contains("w.safetensors") && e.contains("b.weight"), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn atomic_write_replaces_file() {
        let dir = std::env::temp_dir().join(format!("selfspec-atomic-{}", std::process::id()));
        let p = dir.join("a.txt");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert!(!dir.join("a.txt.tmp").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cache_entries_round_trip_and_are_bounded() {
        let dir = std::env::temp_dir().join(format!("selfspec-cache-{}", std::process::id()));
        let key = cache_key(&[b"model", b"f32"]);
        assert_ne!(key, cache_key(&[b"modelf", b"32"]), "length prefixes keep parts apart");
        assert_eq!(cache_read(&dir, "costs", &key, 100), None);
        cache_write(&dir, "costs", &key, b"[1.5]");
        assert_eq!(cache_read(&dir, "costs", &key, 100).as_deref(), Some(&b"[1.5]"[..]));
        assert_eq!(cache_read(&dir, "costs", &key, 3), None, "larger than allowed is a miss");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn safetensors_are_atomic_readable_and_not_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("selfspec-st-{}", std::process::id()));
        let p = dir.join("w.safetensors");
        let t = candle_core::Tensor::new(&[[1.5f32, -2.0], [0.25, 8.0]], &candle_core::Device::Cpu).unwrap();
        let h = t.to_dtype(candle_core::DType::F16).unwrap();
        let ts = std::collections::HashMap::from([("a".to_string(), t.clone()), ("b".to_string(), h)]);
        save_safetensors(&ts, Some(("k", "v")), &p).unwrap();
        let back = candle_core::safetensors::load(&p, &candle_core::Device::Cpu).unwrap();
        assert_eq!(back["a"].to_vec2::<f32>().unwrap(), t.to_vec2::<f32>().unwrap());
        assert_eq!(back["b"].dtype(), candle_core::DType::F16);
        let bytes = std::fs::read(&p).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(header.metadata().as_ref().unwrap()["k"], "v");
        // Group and others may read it as they may read the JSON beside it (umask permitting).
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        let json = dir.join("c.json");
        write_atomic(&json, b"{}").unwrap();
        assert_eq!(mode, std::fs::metadata(&json).unwrap().permissions().mode() & 0o777);
        assert!(!dir.join("w.safetensors.tmp").exists());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn data_files_are_read_when_they_fit() {
        assert!(available_memory().is_some_and(|m| m > 0), "Linux reports MemAvailable");
        let p = std::env::temp_dir().join(format!("selfspec-data-{}.txt", std::process::id()));
        std::fs::write(&p, b"hello").unwrap();
        assert_eq!(read_data(&p).unwrap(), b"hello");
        // A sparse file larger than the memory: refused by its size, never read.
        let big = std::env::temp_dir().join(format!("selfspec-big-{}.txt", std::process::id()));
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(available_memory().unwrap()).unwrap();
        let e = read_data(&big).unwrap_err().to_string();
        assert!(e.contains("available memory") && e.contains("big"), "{e}");
        std::fs::remove_file(&p).ok();
        std::fs::remove_file(&big).ok();
    }

    #[test]
    fn writability_is_checked_up_front() {
        let dir = std::env::temp_dir().join(format!("selfspec-writable-{}", std::process::id()));
        check_writable(&dir.join("sub/report.json")).unwrap();
        assert!(dir.join("sub").is_dir());
        assert_eq!(std::fs::read_dir(dir.join("sub")).unwrap().count(), 0, "the probe is removed");
        check_writable_dir(&dir.join("out")).unwrap();
        assert!(!dir.join("out").exists(), "a folder the check made is removed again");
        assert!(check_writable(&dir).unwrap_err().to_string().contains("is a directory"));
        std::fs::write(dir.join("f"), b"x").unwrap();
        assert!(check_writable_dir(&dir.join("f")).unwrap_err().to_string().contains("not a directory"));
        let e = check_writable(&dir.join("f/r.json")).unwrap_err().to_string();
        assert!(e.contains("f/r.json") && e.contains("cannot be written"), "{e}");
        // A read-only folder (root ignores permissions, so only where they bite).
        use std::os::unix::fs::PermissionsExt;
        let ro = dir.join("ro");
        std::fs::create_dir_all(&ro).unwrap();
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
        if std::fs::write(ro.join("x"), b"").is_err() {
            let e = check_writable(&ro.join("r.json")).unwrap_err().to_string();
            assert!(e.contains("r.json") && e.contains("cannot be written"), "{e}");
        }
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::remove_dir_all(&dir).ok();
    }
}
