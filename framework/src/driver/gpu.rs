//! GPU assignment: which devices a worker sees.

use super::*;

/// The devices (as `CUDA_VISIBLE_DEVICES` entries) a worker asking for `n`
/// GPUs gets: taken round-robin, by worker id, from `RDT_GPUS` (a
/// comma-separated list), else from the driver's own
/// `CUDA_VISIBLE_DEVICES`, else from the devices `nvidia-smi` would number
/// 0..count (counted through `/proc/driver/nvidia/gpus`, or 1 if that is
/// absent). Several workers may share one device (fractional GPUs); a
/// worker never gets the same device twice.
pub(crate) fn gpu_assignment(n: u32, worker: u64) -> String {
    let pool = gpu_pool();
    let k = (n as usize).min(pool.len());
    let start = worker as usize % pool.len();
    (0..k)
        .map(|i| pool[(start + i) % pool.len()].clone())
        .collect::<Vec<_>>()
        .join(",")
}

/// The `CUDA_VISIBLE_DEVICES` value for [`Spawn::on_gpus`]`(ids)`: those
/// entries of the pool, in order.
pub(crate) fn gpu_devices(ids: &[u32]) -> std::result::Result<String, String> {
    let pool = gpu_pool();
    let mut out: Vec<&str> = Vec::with_capacity(ids.len());
    for (i, &id) in ids.iter().enumerate() {
        if ids[..i].contains(&id) {
            return Err(format!("GPU {id} is listed twice in on_gpus({ids:?})"));
        }
        match pool.get(id as usize) {
            Some(d) => out.push(d),
            None => {
                return Err(format!(
                    "on_gpus({ids:?}): there is no GPU {id}; the pool has {} ({})",
                    pool.len(),
                    pool.join(",")
                ))
            }
        }
    }
    Ok(out.join(","))
}

/// The devices GPU workers are placed on (see [`gpu_assignment`]).
/// GR-1: NCCL refuses two ranks on one device ("Duplicate GPU
/// detected"): two members of a `nccl` group that the driver gave the same
/// GPU are refused here, naming both, before any member is asked to join.
/// Members whose GPU the driver did not assign (joined workers) are left to
/// NCCL.
pub(super) fn refuse_shared_gpus(actors: &Actors, members: &[ActorId]) -> Result<()> {
    let mut seen: HashMap<&str, &str> = HashMap::new();
    for m in members {
        let Some(info) = actors.get(&m.0) else {
            continue;
        };
        let Some(gpu) = info.gpu.as_deref() else {
            continue;
        };
        if let Some(first) = seen.insert(gpu, &info.name) {
            return Err(Error::Group(format!(
                "{first} and {} are both on GPU {gpu} (the same GPU): NCCL takes one rank per                  device; give each member its own GPU (`.gpus(1)` with enough devices, or                  `.on_gpus([..])`), or use `cuda_ipc` or `nixl` between actors on one GPU",
                info.name
            )));
        }
    }
    Ok(())
}

pub(super) fn gpu_pool() -> Vec<String> {
    let list = |v: String| -> Vec<String> {
        v.split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect()
    };
    crate::env::gpus()
        .map(list)
        .filter(|l| !l.is_empty())
        .or_else(|| {
            crate::env::cuda_visible_devices()
                .map(list)
                .filter(|l| !l.is_empty())
        })
        .unwrap_or_else(|| {
            let count = std::fs::read_dir("/proc/driver/nvidia/gpus")
                .map(|d| d.count())
                .unwrap_or(1)
                .max(1);
            (0..count).map(|i| i.to_string()).collect()
        })
}

#[cfg(test)]
mod gpu_assignment_tests {
    #[test]
    fn round_robin_over_rdt_gpus() {
        std::env::set_var("RDT_GPUS", "3,5");
        assert_eq!(super::gpu_assignment(1, 0), "3");
        assert_eq!(super::gpu_assignment(1, 1), "5");
        assert_eq!(super::gpu_assignment(1, 2), "3");
        assert_eq!(super::gpu_assignment(2, 1), "5,3");
        assert_eq!(super::gpu_assignment(4, 0), "3,5");
        assert_eq!(super::gpu_devices(&[1]).unwrap(), "5");
        assert_eq!(super::gpu_devices(&[1, 0]).unwrap(), "5,3");
        assert!(super::gpu_devices(&[2]).unwrap_err().contains("no GPU 2"));
        assert!(super::gpu_devices(&[0, 0]).unwrap_err().contains("twice"));
        std::env::remove_var("RDT_GPUS");
    }
}
