//! The instruction-set variants of the block kernels, detected at run time.
//!
//! Release binaries are built for the baseline x86_64 target and run on CPUs from AVX2-only to
//! AVX-512 with VNNI (aarch64: NEON to the dot-product extension and beyond), so the SIMD paths are
//! chosen by `is_x86_feature_detected!` / `is_aarch64_feature_detected!`, never by compile-time target
//! features. Every kernel function takes the variant as an argument: tests run each variant the
//! machine has side by side (in parallel, no global switch), and the model uses [`Isa`]'s per-kernel
//! default.

/// One implementation of a kernel's arithmetic. A kernel implements a subset of these (see its
/// `variants` function) and panics when handed one it does not implement or the CPU lacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Plain Rust, every architecture.
    Portable,
    /// x86_64 AVX2 + FMA + F16C (256-bit registers; `maddubs` for 8-bit dot products).
    Avx2,
    /// [`Isa::Avx2`] plus AVX-512F/VL: the f32-activation tiles two weight rows per register.
    Avx512,
    /// [`Isa::Avx2`] plus AVX-VNNI: 256-bit `vpdpbusd` (Alder Lake and later client cores).
    AvxVnni,
    /// AVX-512F/BW/VL + AVX512-VNNI (+ AVX2/FMA/F16C): 512-bit `vpdpbusd` (Ice Lake server and later,
    /// Zen 4 and later).
    Avx512Vnni,
    /// aarch64 NEON (Advanced SIMD, every aarch64 CPU): 128-bit registers; `smull` for 8-bit products.
    Neon,
    /// [`Isa::Neon`] plus the dot-product extension: `sdot` (ARMv8.2 and later: Apple M1 on, Graviton 2
    /// on, Ampere Altra).
    NeonDot,
}

impl Isa {
    /// Whether the CPU running us has every feature the variant uses.
    pub fn available(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => Isa::Avx2.available() && is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx512.available()
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDot => Isa::Neon.available() && std::arch::is_aarch64_feature_detected!("dotprod"),
            _ => false,
        }
    }

    /// The first of `preference` the CPU has (`Portable` if none).
    pub(crate) fn best_of(preference: &[Isa]) -> Isa {
        preference
            .iter()
            .copied()
            .find(|i| i.available())
            .unwrap_or(Isa::Portable)
    }
}

/// The CPU's family (base plus extended, as AMD numbers them: 0x19 Zen 3 and Zen 4, 0x1A Zen 5) when
/// it is an AMD one, for the few kernel settings that were measured to differ by microarchitecture.
#[allow(unused_unsafe)] // `__cpuid` is an unsafe fn in Rust 1.93 and before (`cpuid` is baseline x86_64)
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the x86 kernels' only
pub(crate) fn amd_family() -> Option<u32> {
    #[cfg(target_arch = "x86_64")]
    {
        static FAMILY: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
        *FAMILY.get_or_init(|| unsafe {
            use std::arch::x86_64::__cpuid;
            let vendor = __cpuid(0);
            let amd = [vendor.ebx, vendor.edx, vendor.ecx]
                .iter()
                .flat_map(|r| r.to_le_bytes())
                .eq(*b"AuthenticAMD");
            let eax = __cpuid(1).eax;
            let (base, extended) = ((eax >> 8) & 0xF, (eax >> 20) & 0xFF);
            amd.then_some(if base == 0xF { base + extended } else { base })
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}
