//! Which instructions this CPU has, detected once per process. Every kernel path gives the same
//! bits; they differ only in speed, so reports name the path they ran on ([`cpu_kernels`]).

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

/// Whether the AVX2 kernels can run here (AVX2, FMA and F16C). Every AVX-512 CPU so far has
/// them too; the integer kernel uses them on AVX-512 CPUs without VNNI, and the tests run the
/// AVX2 kernels against the portable ones wherever they can, not only where [`isa`] picks them.
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        allowed() >= Cap::Avx2 && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// This CPU as `/proc/cpuinfo` names it and the kernels' paths on it: what cached timings are
/// keyed by (timings from another CPU, or another path, do not apply here).
pub fn cpu_identity() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|m| m.trim().to_string()))
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!("{model}; {}", cpu_kernels())
}

/// The instruction-set paths the CPU kernels take on this machine, as reports name them
/// ("AVX-512, int8 on VNNI, bf16 on AMX", "AVX2", "portable"). Why reports carry it: every path
/// gives the same bits, but timings, and so speed-ups and `auto`'s trees, are comparable only
/// between runs on the same path.
pub fn cpu_kernels() -> String {
    let mut s = match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => "AVX-512".to_string(),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => "AVX2".to_string(),
        Isa::Portable => "portable".to_string(),
    };
    if vnni() {
        s.push_str(", int8 on VNNI");
    } else if isa() != Isa::Avx2 && has_avx2() {
        s.push_str(", int8 on AVX2");
    }
    if amx_available() {
        s.push_str(", bf16 on AMX");
    }
    s
}

/// The widest path `SELFSPEC_ISA` lets the kernels take.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Cap {
    Portable,
    Avx2,
    Avx512,
}

/// `SELFSPEC_ISA=avx2` or `portable` keeps the kernels below what the CPU has (unset or
/// `avx512`: no limit). Why: every path gives the same bits, so only speed tells them apart, and
/// this is how a machine with AVX-512 measures the paths AVX2-only CPUs take. The kernel tests
/// follow it too (leave it unset for them to cover every path the CPU has). An unknown value is
/// reported and ignored.
fn allowed() -> Cap {
    static CAP: std::sync::OnceLock<Cap> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| match std::env::var("SELFSPEC_ISA") {
        Err(_) => Cap::Avx512,
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "" | "avx512" => Cap::Avx512,
            "avx2" => Cap::Avx2,
            "portable" => Cap::Portable,
            _ => {
                eprintln!("warning: SELFSPEC_ISA={v:?} is not avx512, avx2 or portable; ignored");
                Cap::Avx512
            }
        },
    })
}

pub(crate) fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if allowed() >= Cap::Avx512 && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq") {
                return Isa::Avx512;
            }
            if has_avx2() {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    })
}

/// Whether the 8-bit integer kernels can use AVX-512 VNNI (`vpdpbusd`).
pub(crate) fn vnni() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            allowed() >= Cap::Avx512 && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vnni")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// Which kernel runs: AMX where the CPU has it and the OS grants the tile state.
pub fn amx_available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        if std::env::var("SELFSPEC_NO_AMX").is_ok_and(|v| v == "1") || allowed() < Cap::Avx512 {
            return false;
        }
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            request_amx_permission()
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            false
        }
    })
}

/// Linux hands out the 8 KB tile register state only on request (`arch_prctl`
/// `ARCH_REQ_XCOMP_PERM` for `XFEATURE_XTILEDATA`); the grant covers the whole process.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_amx_permission() -> bool {
    // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
    let leaf = std::arch::x86_64::__cpuid_count(7, 0);
    if leaf.edx & (1 << 22) == 0 || leaf.edx & (1 << 24) == 0 {
        return false;
    }
    const SYS_ARCH_PRCTL: usize = 158;
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    let ret: isize;
    // SAFETY: a plain system call that changes no memory of ours.
    unsafe {
        std::arch::asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL as isize => ret, in("rdi") ARCH_REQ_XCOMP_PERM, in("rsi") XFEATURE_XTILEDATA,
             lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret == 0
}

