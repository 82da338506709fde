//! The randomized fault soak, short form, with three seeds (see
//! `rdt_integration_tests::fault_soak`; `bench soak --faults` runs the long
//! form). A failure names its seed: `fault_soak::run(seed, ops)` plays it
//! again.

use rdt_integration_tests::{deadline, fault_soak};

/// Operations per seed: the three seeds take well under two minutes on
/// the 2-core CI machine.
const OPS: usize = 400;

/// One soak at a time: each counts this process's children.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn soak(seed: u64) {
    let _one = ONE_AT_A_TIME.lock().await;
    let report = deadline(150, fault_soak::run(seed, OPS)).await;
    eprintln!("{report:?}");
    fault_soak::assert_clean(&report, 64 << 10);
}

#[tokio::test(flavor = "multi_thread")]
async fn fault_soak_seed_1() {
    soak(1).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn fault_soak_seed_2() {
    soak(0x5eed_0002).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn fault_soak_seed_3() {
    soak(0xdead_beef).await;
}
