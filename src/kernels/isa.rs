//! The instruction-set variants of the block kernels, detected at run time.
//!
//! Release binaries are built for the baseline x86_64 target and run on CPUs from AVX2-only to
//! AVX-512 with VNNI (aarch64: NEON to the dot-product extension and beyond), so the SIMD paths are
//! chosen by `is_x86_feature_detected!` / `is_aarch64_feature_detected!`, never by compile-time target
//! features. Every kernel function takes the variant as an argument: tests run each variant the
//! machine has side by side (in parallel, no global switch), and the model uses [`Isa`]'s per-kernel
//! default. [`ISA_ENV`] caps what a process uses, to run and time a lesser variant on a CPU that has
//! better ones.

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

/// The environment variable that caps the variants a process uses at one of [`Isa::ALL`], by name
/// (`avx2`, say): a variant is used only where its features are all the named one's. For tests and
/// timings of a lesser variant on a CPU that has better ones.
pub const ISA_ENV: &str = "PROBESPEC_ISA";

impl Isa {
    /// Every variant, in the order of their names in [`ISA_ENV`]'s error.
    pub const ALL: [Isa; 7] = [
        Isa::Portable,
        Isa::Avx2,
        Isa::Avx512,
        Isa::AvxVnni,
        Isa::Avx512Vnni,
        Isa::Neon,
        Isa::NeonDot,
    ];

    /// The variant's name, as [`ISA_ENV`] takes it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::AvxVnni => "avxvnni",
            Isa::Avx512Vnni => "avx512vnni",
            Isa::Neon => "neon",
            Isa::NeonDot => "neondot",
        }
    }

    /// The CPU features a variant uses, one bit each: a variant may stand in for another whose bits it
    /// all has.
    fn features(self) -> u8 {
        const AVX2: u8 = 1;
        const AVX512: u8 = 2;
        const AVX_VNNI: u8 = 4;
        const AVX512_VNNI: u8 = 8;
        const NEON: u8 = 16;
        const DOT: u8 = 32;
        match self {
            Isa::Portable => 0,
            Isa::Avx2 => AVX2,
            Isa::Avx512 => AVX2 | AVX512,
            Isa::AvxVnni => AVX2 | AVX_VNNI,
            Isa::Avx512Vnni => AVX2 | AVX512 | AVX512_VNNI,
            Isa::Neon => NEON,
            Isa::NeonDot => NEON | DOT,
        }
    }

    /// Whether the process may use the variant: the CPU running us has every feature it uses, and
    /// [`ISA_ENV`] allows them.
    pub fn available(self) -> bool {
        self.detected() && allowed(self)
    }

    /// Whether the CPU running us has every feature the variant uses.
    pub fn detected(self) -> bool {
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
                Isa::Avx2.detected()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => Isa::Avx2.detected() && is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx512.detected()
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDot => Isa::Neon.detected() && std::arch::is_aarch64_feature_detected!("dotprod"),
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

/// The cap [`ISA_ENV`] sets: `Ok(None)` when it is unset or empty; an error, naming the choices, for a
/// name that is none of them or a variant this CPU lacks.
pub fn ceiling_from_env() -> Result<Option<Isa>, String> {
    let name = std::env::var(ISA_ENV).unwrap_or_default();
    if name.is_empty() {
        return Ok(None);
    }
    let names = || Isa::ALL.map(Isa::name).join(", ");
    match Isa::ALL.into_iter().find(|i| i.name() == name) {
        None => Err(format!("{ISA_ENV}={name}: expected one of {}", names())),
        Some(isa) if !isa.detected() => Err(format!("{ISA_ENV}={name}: this CPU lacks it")),
        Some(isa) => Ok(Some(isa)),
    }
}

/// Whether [`ISA_ENV`] allows every feature of `isa` (read once; a bad value caps nothing, front ends
/// refuse it first through [`ceiling_from_env`]).
pub(crate) fn allowed(isa: Isa) -> bool {
    static CEILING: std::sync::OnceLock<Option<Isa>> = std::sync::OnceLock::new();
    let ceiling = *CEILING.get_or_init(|| ceiling_from_env().ok().flatten());
    ceiling.is_none_or(|c| isa.features() & !c.features() == 0)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variant_stands_in_only_for_those_whose_features_it_has() {
        let covers = |a: Isa, b: Isa| b.features() & !a.features() == 0;
        assert!(covers(Isa::Avx512Vnni, Isa::Avx512));
        assert!(covers(Isa::Avx512Vnni, Isa::Avx2));
        assert!(
            !covers(Isa::Avx512Vnni, Isa::AvxVnni),
            "AVX-VNNI is a flag of its own (Zen 4 lacks it)"
        );
        assert!(!covers(Isa::Avx2, Isa::Avx512));
        assert!(covers(Isa::NeonDot, Isa::Neon));
        assert!(!covers(Isa::Neon, Isa::Avx2));
        assert!(Isa::ALL.iter().all(|&i| covers(i, Isa::Portable)));
        let mut names: Vec<_> = Isa::ALL.map(Isa::name).to_vec();
        names.dedup();
        assert_eq!(names.len(), Isa::ALL.len());
    }
}
