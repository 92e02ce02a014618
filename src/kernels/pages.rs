//! Weight buffers on transparent huge pages.
//!
//! Decoding reads every weight once per step, front to back. On 4 KiB pages that is a TLB miss every
//! 4 KiB of weights, and each miss is a two-dimensional page walk in a virtual machine. Linux backs
//! anonymous memory with 2 MiB pages only where the program asks (`transparent_hugepage` is `madvise`
//! on most distributions) and only for whole, aligned 2 MiB ranges: a plain `Vec` neither asks nor
//! starts on one. [`HugeBytes`] maps its own memory with a 2 MiB-aligned start and advises its whole
//! 2 MiB ranges; the last partial range stays on small pages, so no page is allocated past the data.
//! Interleaved call by call with the same products on 4 KiB pages, the packed products of Qwen3-4B's
//! shapes took 2-4% less time on an EPYC Zen 4. Loading changed both ways there: a 2 MiB page is
//! cleared whole at its first touch, which the VM made slow at times (docs/BENCHMARKS.md).

use std::ops::{Deref, DerefMut};

/// The size of a transparent huge page (x86-64, and arm64 on 4 KiB pages) and of the ranges advised.
const HUGE_PAGE: usize = 2 << 20;

/// Zeroed bytes; those of a buffer of at least [`HUGE_PAGE`] bytes on huge pages where the system
/// grants them (Linux), otherwise an ordinary heap buffer.
pub struct HugeBytes(Backing);

enum Backing {
    Heap(Vec<u8>),
    #[cfg(target_os = "linux")]
    Mapped {
        map: memmap2::MmapMut,
        start: usize,
        len: usize,
    },
}

impl HugeBytes {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        #[cfg(target_os = "linux")]
        if len >= HUGE_PAGE {
            // Mapped one huge page long so that an aligned start lies inside; the slack is never touched,
            // so it costs address space only.
            if let Ok(map) = memmap2::MmapMut::map_anon(len + HUGE_PAGE) {
                let start = (map.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - map.as_ptr() as usize;
                // Refused where huge pages are off (`never`): the buffer is then on small pages, as a
                // Vec's would be.
                let _ = map.advise_range(memmap2::Advice::HugePage, start, len / HUGE_PAGE * HUGE_PAGE);
                return HugeBytes(Backing::Mapped { map, start, len });
            }
        }
        HugeBytes(Backing::Heap(vec![0; len]))
    }
}

impl Deref for HugeBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            Backing::Heap(v) => v,
            #[cfg(target_os = "linux")]
            Backing::Mapped { map, start, len } => &map[*start..][..*len],
        }
    }
}

impl DerefMut for HugeBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.0 {
            Backing::Heap(v) => v,
            #[cfg(target_os = "linux")]
            Backing::Mapped { map, start, len } => &mut map[*start..][..*len],
        }
    }
}

impl Clone for HugeBytes {
    fn clone(&self) -> Self {
        let mut copy = HugeBytes::zeroed(self.len());
        copy.copy_from_slice(self);
        copy
    }
}

impl std::fmt::Debug for HugeBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HugeBytes({} bytes)", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_writable_and_cloned_whole() {
        for len in [0, 1, 4095, HUGE_PAGE - 1, HUGE_PAGE, 3 * HUGE_PAGE + 12345] {
            let mut b = HugeBytes::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0), "{len} bytes not zeroed");
            for (i, x) in b.iter_mut().enumerate() {
                *x = (i % 251) as u8;
            }
            let c = b.clone();
            assert_eq!(c.len(), len);
            assert!(
                c.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8),
                "{len}-byte clone differs"
            );
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn large_buffers_start_on_a_huge_page_boundary() {
        let b = HugeBytes::zeroed(HUGE_PAGE + 1);
        assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
    }
}
