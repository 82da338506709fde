use super::*;
use std::time::{Duration, Instant};

fn desc(addr: usize, len: usize) -> Desc {
    Desc {
        mem: Mem::Dram,
        addr,
        len,
        dev: 0,
    }
}

fn pair(r: usize, l: usize, len: usize) -> Pair {
    Pair {
        remote: desc(r, len),
        remote_reg: 1,
        local: desc(l, len),
        local_reg: 2,
    }
}

#[test]
fn ucx_memory_hooks_are_off_unless_the_process_chose() {
    use std::ffi::OsStr;
    assert_eq!(ucx_default(None), Some("no"));
    for chosen in ["yes", "no", "y", ""] {
        assert_eq!(ucx_default(Some(OsStr::new(chosen))), None, "{chosen:?}");
    }
}

#[test]
fn neighbours_become_one_descriptor_and_others_stay_apart() {
    // Three neighbours with the same 64-byte gap on both sides, given
    // out of order; then one whose local gap differs.
    let pairs = vec![
        pair(1128, 5128, 1000),
        pair(0, 4000, 1000),
        pair(2192, 6192, 100),
        pair(3000, 9000, 10),
    ];
    let lists = coalesce(pairs);
    assert_eq!(lists.len(), 1, "one pair of memory types");
    let (local, remote) = &lists[0];
    assert_eq!(remote, &vec![desc(0, 2292), desc(3000, 10)]);
    assert_eq!(local, &vec![desc(4000, 2292), desc(9000, 10)]);
}

#[test]
fn each_pair_of_memory_types_gets_its_own_list() {
    // Host and device neighbours never merge, and each list is one
    // type on each side, whatever order the tensors came in.
    let mut on_gpu = pair(1000, 2000, 1000);
    on_gpu.local.mem = Mem::Vram;
    let lists = coalesce(vec![pair(2000, 1000, 1000), on_gpu, pair(0, 0, 1000)]);
    assert_eq!(lists.len(), 2);
    for (local, remote) in &lists {
        assert!(local.iter().all(|d| d.mem == local[0].mem));
        assert!(remote.iter().all(|d| d.mem == remote[0].mem));
    }
    let host = lists.iter().find(|(l, _)| l[0].mem == Mem::Dram).unwrap();
    assert_eq!(host.1, vec![desc(0, 1000), desc(2000, 1000)]);
    let gpu = lists.iter().find(|(l, _)| l[0].mem == Mem::Vram).unwrap();
    assert_eq!(gpu.1, vec![desc(1000, 1000)]);
}

#[test]
fn descriptors_never_span_two_registrations() {
    let mut b = pair(1000, 2000, 10);
    b.remote_reg = 7;
    let lists = coalesce(vec![pair(0, 1000, 1000), b]);
    assert_eq!(lists[0].1.len(), 2);
}

/// Handles of `tensors` in one host registration of `len` bytes at
/// `base`.
fn in_one_dram_region(base: u64, len: u64, tensors: Vec<Piece>) -> Handles {
    Handles {
        agent: "a".into(),
        conn: vec![1],
        regions: vec![RegionHandle {
            generation: 1,
            mem: Mem::Dram,
            base,
            len,
            dev: 0,
            md: vec![1],
        }],
        tensors,
    }
}

#[test]
fn a_plan_is_found_by_its_layout_without_reading_the_content_again() {
    // 100 host tensors of 64 B, neighbours in one registration (only
    // metadata: no tensor, so the process-wide host pool, which
    // another test counts, is left alone).
    let metas: Vec<TensorMeta> = (0..100)
        .map(|_| TensorMeta {
            dtype: crate::DType::U8,
            shape: [64usize][..].into(),
            device: Device::Cpu,
        })
        .collect();
    let h = in_one_dram_region(
        1 << 20,
        1 << 20,
        (0..100)
            .map(|i| Piece {
                region: 0,
                offset: i * 64,
                len: 64,
            })
            .collect(),
    );
    let ex = Exported {
        metas,
        handles: h.encode().unwrap(),
        inline: Vec::new(),
    };
    let plan = ReadPlan::new(&ex, PlanTarget::Host).unwrap();
    assert_eq!(plan.lists.len(), 1, "one coalesced list");
    // Unknown layout: the content decides.
    assert!(plan.fits(&ex, PlanTarget::Host, None));
    let mut other = ex.clone();
    other.metas[0].shape = [32usize, 2][..].into();
    assert!(!plan.fits(&other, PlanTarget::Host, None));
    // A layout is taken on once its content matched...
    assert!(!plan.fits(&other, PlanTarget::Host, Some(6)));
    assert!(plan.fits(&ex, PlanTarget::Host, Some(5)));
    // ... and from then on answers without reading the content (the
    // framework's promise: the same layout, the same bytes; the other
    // content here shows nothing was compared).
    assert!(plan.fits(&other, PlanTarget::Host, Some(5)));
    assert!(!plan.fits(&other, PlanTarget::Host, Some(6)));
    // The target is always checked.
    assert!(!plan.fits(&ex, PlanTarget::Any, Some(5)));
}

#[test]
fn handles_travel_as_runs_and_offsets() {
    let metas: Vec<TensorMeta> = [4usize, 8, 0, 2]
        .iter()
        .map(|&n| Tensor::zeros(crate::DType::F32, &[n]).meta())
        .collect();
    let region = |g| RegionHandle {
        generation: g,
        mem: Mem::Dram,
        base: 4096 * g,
        len: 1 << 20,
        dev: 0,
        md: vec![g as u8],
    };
    let h = Handles {
        agent: "a".into(),
        conn: vec![1, 2],
        regions: vec![region(1), region(2)],
        tensors: [(0u32, 0u64), (0, 512), (1, 7 << 40), (0, 1024)]
            .iter()
            .zip(&metas)
            .map(|(&(region, offset), m)| Piece {
                region,
                offset,
                len: m.nbytes() as u64,
            })
            .collect(),
    };
    let bytes = h.encode().unwrap();
    let back = Handles::decode(&bytes, &metas).unwrap();
    assert_eq!((back.agent.as_str(), &back.conn[..]), ("a", &[1u8, 2][..]));
    assert_eq!(back.regions.len(), 2);
    let got: Vec<(u32, u64, u64)> = back
        .tensors
        .iter()
        .map(|p| (p.region, p.offset, p.len))
        .collect();
    let want: Vec<(u32, u64, u64)> = h
        .tensors
        .iter()
        .map(|p| (p.region, p.offset, p.len))
        .collect();
    assert_eq!(got, want);
    // Three runs: two tensors in registration 0, one in 1, one in 0.
    let w: HandlesWire = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(w.runs, [(0, 2), (1, 1), (0, 1)]);
    // The gaps, one per tensor, and back as runs.
    let zigzags = crate::metas_wire::expand_runs(&w.gaps).unwrap();
    assert_eq!(zigzags.len(), 4);
    let runs_of = |v: &[u64]| {
        let mut b = Vec::new();
        crate::metas_wire::put_runs(&mut b, v.iter().copied());
        b
    };
    // Neighbours (a flat buffer's views) are a byte each.
    let flat: Vec<TensorMeta> = (0..1000)
        .map(|_| Tensor::zeros(crate::DType::U8, &[4096]).meta())
        .collect();
    let packed = Handles {
        tensors: (0..1000)
            .map(|i| Piece {
                region: 0,
                offset: 8192 + 4096 * i,
                len: 4096,
            })
            .collect(),
        ..h.clone()
    };
    let pb = packed.encode().unwrap();
    let pw: HandlesWire = postcard::from_bytes(&pb).unwrap();
    assert!(
        pw.gaps.len() <= 6,
        "the first gap (8192) and one run of 999 zeros: {} bytes",
        pw.gaps.len()
    );
    let offsets: Vec<u64> = Handles::decode(&pb, &flat)
        .unwrap()
        .tensors
        .iter()
        .map(|p| p.offset)
        .collect();
    assert_eq!(
        offsets,
        (0..1000).map(|i| 8192 + 4096 * i).collect::<Vec<_>>()
    );
    // Fewer metadata than tensors, runs that do not add up, and cut
    // offsets are errors, never a panic.
    assert!(Handles::decode(&bytes, &metas[..3])
        .unwrap_err()
        .contains("malformed"));
    for bad in [
        HandlesWire {
            runs: vec![(0, 5)],
            ..postcard::from_bytes(&bytes).unwrap()
        },
        // Cut short, one too many, a first offset below 0, and a run
        // without its count.
        HandlesWire {
            gaps: runs_of(&zigzags[..zigzags.len() - 1]),
            ..postcard::from_bytes(&bytes).unwrap()
        },
        HandlesWire {
            gaps: runs_of(&[&zigzags[..], &[0]].concat()),
            ..postcard::from_bytes(&bytes).unwrap()
        },
        HandlesWire {
            gaps: runs_of(&[&[zigzag(-1)][..], &zigzags[1..]].concat()),
            ..postcard::from_bytes(&bytes).unwrap()
        },
        HandlesWire {
            gaps: vec![1],
            ..postcard::from_bytes(&bytes).unwrap()
        },
    ] {
        let b = postcard::to_allocvec(&bad).unwrap();
        assert!(Handles::decode(&b, &metas)
            .unwrap_err()
            .contains("malformed"));
    }
    assert!(Handles::decode(&[1, 2, 3], &metas).is_err());
}

#[test]
fn malformed_handles_are_errors() {
    let meta = Tensor::zeros(crate::DType::F32, &[4]).meta();
    let h = in_one_dram_region(
        0,
        8,
        vec![Piece {
            region: 0,
            offset: 0,
            len: 16,
        }],
    );
    let e = check_handles(&h, std::slice::from_ref(&meta)).unwrap_err();
    assert!(e.contains("reaches past its registration"), "{e}");
    let mut bad = h.clone();
    bad.tensors[0].region = 3;
    assert!(check_handles(&bad, std::slice::from_ref(&meta))
        .unwrap_err()
        .contains("names registration 3"));
    assert!(check_handles(&h, &[])
        .unwrap_err()
        .contains("describe 1 tensors"));
}

/// Two agents of this process read each other's memory through UCX:
/// the binding, registration, metadata exchange, the READ, the poller
/// and the notification, for real (needs NIXL: scripts/install-nixl.sh).
#[test]
fn an_agent_reads_another_agents_memory() {
    let a = Arc::new(Agent::new("rdt-unit-a").expect("NIXL is installed"));
    let b = Arc::new(Agent::new("rdt-unit-b").unwrap());
    let len = 1 << 20;
    let src = HostRegion::new(&a, len).unwrap();
    let dst = HostRegion::new(&b, len).unwrap();
    for i in 0..len {
        // SAFETY: within the region, which nothing else uses.
        unsafe { *src.ptr().add(i) = (i % 251) as u8 };
    }
    assert_eq!(b.load_remote(a.connection_md()).unwrap(), "rdt-unit-a");
    assert_eq!(b.load_remote(&src.slab.reg.md).unwrap(), "rdt-unit-a");
    let at = |r: &HostRegion| desc(r.ptr() as usize, len);
    let (req, _) = b
        .post_read(
            &[at(&dst)],
            &[at(&src)],
            "rdt-unit-a",
            &42u64.to_le_bytes(),
            false,
        )
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let done = Poller::get(&b).watch(req, Box::new(()));
    let r = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(20), done).await })
        .expect("the read ends within 20 s")
        .unwrap();
    r.unwrap();
    // SAFETY: the read is released; nothing writes the region.
    let got = unsafe { std::slice::from_raw_parts(dst.ptr(), len) };
    assert!(got.iter().enumerate().all(|(i, &v)| v == (i % 251) as u8));
    expect_notification(&a, "rdt-unit-b", &42u64.to_le_bytes());
    // A notification on its own (rdt's reads send theirs so): the
    // count of reads since the last one, to each producer.
    send_notices(&b, HashMap::from([("rdt-unit-a".to_string(), 7)]));
    expect_notification(&a, "rdt-unit-b", &7u64.to_le_bytes());
}

#[test]
fn a_notice_reports_its_count_of_reads() {
    assert_eq!(reads_in(&7u64.to_le_bytes()), 7);
    assert_eq!(reads_in(&1u64.to_le_bytes()), 1);
    // Not rdt's: one read.
    assert_eq!(reads_in(b"hello"), 1);
    assert_eq!(reads_in(&[]), 1);
}

/// Waits (20 s at most) for `agent`'s next notifications: exactly one,
/// `msg` from `from`.
fn expect_notification(agent: &Agent, from: &str, msg: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let n = agent.take_notifications().unwrap();
        if !n.is_empty() {
            assert_eq!(n, vec![(from.to_string(), msg.to_vec())]);
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no notification from {from} within 20 s"
        );
        std::thread::yield_now();
    }
}
