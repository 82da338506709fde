//! Workers started by hand (`--rdt-connect`), as Slurm, Kubernetes or
//! mpirun would start them: on loopback, and on another "host" — a second
//! network namespace joined by a veth pair — including a cut link.

use std::time::{Duration, Instant};

use rdt::prelude::*;
use rdt_integration_tests::actors::*;
use rdt_integration_tests::{deadline, spin_until};

fn volunteer(addr: &str, token: &str) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(std::env::current_exe().unwrap());
    c.args(["--rdt-connect", addr])
        .env("RDT_TOKEN", token)
        .kill_on_drop(true);
    c
}

#[tokio::test]
async fn worker_started_by_hand_joins_and_hosts_an_actor() {
    deadline(60, async {
        rdt_integration_tests::logs();
        let rt = Runtime::builder()
            .listen("127.0.0.1:0")
            .start()
            .await
            .unwrap();
        let addr = rt.control_address().unwrap().to_string();
        let mut w = volunteer(&addr, &rt.join_token()).spawn().unwrap();
        let p = rt.spawn::<Producer>(()).on_joined_worker().await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        assert_eq!(p.pid(), None, "not a process of ours");
        rt.create_collective_group(&[p.id(), c.id()], Transport::Tcp)
            .await
            .unwrap();
        let r = p.make(2.0, 1 << 20).transport(Transport::Tcp).remote();
        assert_eq!(
            rt.get(c.sum(&r).remote()).await.unwrap(),
            (2u64 << 20) as f64
        );
        let r = p.make(1.0, 1000).remote();
        assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), 1000.0);
        // The worker goes away: its calls fail, the rest works.
        w.start_kill().unwrap();
        w.wait().await.unwrap();
        let e = rt.get(p.echo(1).remote()).await.unwrap_err();
        assert!(matches!(e, Error::ActorDied { .. }), "{e}");
        assert_eq!(
            rt.get(c.sum(Tensor::full(1.0f32, &[3])).remote())
                .await
                .unwrap(),
            3.0
        );
    })
    .await;
}

#[tokio::test]
async fn a_worker_with_the_wrong_token_is_refused() {
    deadline(60, async {
        rdt_integration_tests::logs();
        let rt = Runtime::builder()
            .listen("127.0.0.1:0")
            .spawn_timeout(Duration::from_secs(2))
            .start()
            .await
            .unwrap();
        let addr = rt.control_address().unwrap().to_string();
        let status = volunteer(&addr, &"00".repeat(32)).status().await.unwrap();
        assert!(!status.success(), "an impostor worker exits with an error");
        let e = rt
            .spawn::<Producer>(())
            .on_joined_worker()
            .await
            .unwrap_err();
        assert!(e.to_string().contains("no worker joined"), "{e}");
        // The runtime is undisturbed.
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        assert_eq!(rt.get(c.seen().remote()).await.unwrap(), 0);
    })
    .await;
}

/// Two network namespaces joined by a veth pair; deleted on drop.
struct TwoHosts {
    a: String,
    b: String,
    ip_a: String,
    ip_b: String,
}

fn ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("this test needs iproute2 (`ip`) and root: {e}"));
    assert!(
        out.status.success(),
        "`ip {}` failed (this test needs root and network namespaces): {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TwoHosts {
    /// Names and addresses unique per process and per pair (tests of one
    /// binary run side by side).
    fn new() -> TwoHosts {
        static PAIRS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let pair = PAIRS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!("{}x{pair}", std::process::id());
        let net = std::process::id() % 250;
        let h = TwoHosts {
            a: format!("rdt-a-{id}"),
            b: format!("rdt-b-{id}"),
            ip_a: format!("10.{}.{net}.1", 77 + pair),
            ip_b: format!("10.{}.{net}.2", 77 + pair),
        };
        let (va, vb) = (format!("rdta{id}"), format!("rdtb{id}"));
        let (va, vb) = (&va[..va.len().min(15)], &vb[..vb.len().min(15)]);
        ip(&["netns", "add", &h.a]);
        ip(&["netns", "add", &h.b]);
        ip(&["link", "add", va, "type", "veth", "peer", "name", vb]);
        ip(&["link", "set", va, "netns", &h.a]);
        ip(&["link", "set", vb, "netns", &h.b]);
        for (ns, dev, addr) in [(&h.a, va, &h.ip_a), (&h.b, vb, &h.ip_b)] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        h
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", ns])
                .status();
        }
    }
}

/// The driver and one local worker on "host A", a worker started by hand
/// on "host B"; tcp between them; then the link is cut mid-transfer.
#[tokio::test]
async fn worker_on_another_host_and_a_cut_link() {
    deadline(120, in_host_a("two_hosts_driver")).await;
}

/// NIXL between hosts (UCX over TCP, across the veth pair: NIXL's reason to
/// exist), then the link cut in the middle of a read.
#[tokio::test]
async fn nixl_between_two_hosts_and_a_link_cut_mid_read() {
    deadline(120, in_host_a("two_hosts_nixl_driver")).await;
}

/// Runs the ignored test `driver` as the driver on "host A" (namespace A),
/// with a fresh pair of hosts; passes if it printed `TWO-HOSTS-OK`.
async fn in_host_a(driver: &str) {
    let hosts = TwoHosts::new();
    let out = tokio::process::Command::new("ip")
        .args(["netns", "exec", &hosts.a])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            driver,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            "RDT_TEST_HOSTS",
            format!("{} {} {}", hosts.b, hosts.ip_a, hosts.ip_b),
        )
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("TWO-HOSTS-OK"),
        "the driver on host A ({driver}) failed:\n{text}"
    );
    // What happened at the cut, for `--nocapture`.
    for line in text.lines().filter(|l| l.starts_with("the read")) {
        println!("{line}");
    }
}

/// Not a test on its own: the driver side of
/// `worker_on_another_host_and_a_cut_link`, run inside namespace A.
#[tokio::test]
#[ignore = "run by worker_on_another_host_and_a_cut_link"]
async fn two_hosts_driver() {
    let (rt, mut w, p, c) = two_hosts().await;
    rt.create_collective_group(&[p.id(), c.id()], Transport::Tcp)
        .await
        .unwrap();
    // Across the veth pair, both directions of the control plane and tcp.
    let r = p.make(1.0, 2 << 20).transport(Transport::Tcp).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        (2u64 << 20) as f64
    );
    // shm cannot cross hosts: a clear error, not a hang.
    let s = p.make(1.0, 16).transport(Transport::Shm).remote();
    let e = rt.get(c.sum(&s).remote()).await.unwrap_err();
    assert!(e.root_cause().to_string().contains("one host"), "{e}");
    // Cut the link in the middle of a large transfer.
    let big = p.make(1.0, 64 << 20).transport(Transport::Tcp).remote();
    rt.wait(&big).await.unwrap();
    let call = c.sum(&big).remote();
    let t0 = Instant::now();
    cut_link();
    match rt.get(&call).await {
        Ok(v) => assert_eq!(v, (64u64 << 20) as f64, "if it finished, it is whole"),
        Err(e) => {
            let root = e.root_cause();
            assert!(
                matches!(root, Error::Transport(_) | Error::ActorDied { .. }),
                "{e}"
            );
        }
    }
    host_b_is_gone(&rt, &p, &mut w, t0).await;
    // Host A's actor is fine.
    assert_eq!(
        rt.get(c.sum(Tensor::full(1.0f32, &[4])).remote())
            .await
            .unwrap(),
        4.0
    );
    println!("TWO-HOSTS-OK");
}

/// The driver of a two-host test, in namespace A (from `RDT_TEST_HOSTS`),
/// with short deadlines; a worker started by hand on "host B" (its own
/// network namespace and host name) hosting a producer, and a local
/// consumer on host A.
async fn two_hosts() -> (
    Runtime,
    tokio::process::Child,
    ProducerHandle,
    ConsumerHandle,
) {
    let spec = std::env::var("RDT_TEST_HOSTS").expect("run by a two-host test only");
    let parts: Vec<&str> = spec.split(' ').collect();
    let (ns_b, ip_a) = (parts[0], parts[1]);
    rdt_integration_tests::logs();
    let rt = Runtime::builder()
        .listen(format!("{ip_a}:0"))
        .tcp_bind(format!("{ip_a}:0"))
        .transfer_timeout(Duration::from_secs(3))
        .heartbeat_timeout(Duration::from_secs(2))
        .start()
        .await
        .unwrap();
    let addr = rt.control_address().unwrap().to_string();
    let w = tokio::process::Command::new("unshare")
        .args([
            "--uts",
            "sh",
            "-c",
            "hostname rdt-host-b && exec \"$@\"",
            "sh",
            "ip",
            "netns",
            "exec",
            ns_b,
        ])
        .arg(std::env::current_exe().unwrap())
        .args(["--rdt-connect", &addr])
        .env("RDT_TOKEN", rt.join_token())
        // UCX tells nodes apart by boot id, so it would take the two
        // namespaces for one node and read across them by cross-memory
        // attach. Another host shares no memory: host B offers UCX only TCP
        // on its end of the link, as a real remote node would.
        .env("UCX_TLS", "tcp")
        .env("UCX_NET_DEVICES", link_end().replacen("rdta", "rdtb", 1))
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let p = rt.spawn::<Producer>(()).on_joined_worker().await.unwrap();
    let c = rt.spawn::<Consumer>(()).await.unwrap();
    (rt, w, p, c)
}

/// Host A's end of the veth pair (seen from namespace A).
fn link_end() -> String {
    std::fs::read_dir("/sys/class/net")
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .find(|n| n.starts_with("rdta"))
        .expect("the veth end of host A")
}

/// Bytes host A has received over the link.
fn link_rx_bytes() -> u64 {
    std::fs::read_to_string(format!("/sys/class/net/{}/statistics/rx_bytes", link_end()))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Takes host A's end of the veth pair down (run in namespace A).
fn cut_link() {
    ip(&["link", "set", &link_end(), "down"]);
}

/// After the cut at `t0`: host B's actor is declared dead by the heartbeat
/// in bounded time, and its worker, cut off from its driver, exits by
/// itself.
async fn host_b_is_gone(
    rt: &Runtime,
    p: &ProducerHandle,
    w: &mut tokio::process::Child,
    t0: Instant,
) {
    let e = rt.get(p.echo(1).remote()).await.unwrap_err();
    assert!(
        matches!(&e, Error::ActorDied { detail, .. } if detail.contains("silent")),
        "{e}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "took {:?}",
        t0.elapsed()
    );
    let status = tokio::time::timeout(Duration::from_secs(15), w.wait())
        .await
        .expect("the cut-off worker exits within its heartbeat")
        .unwrap();
    assert!(!status.success(), "{status:?}");
}

/// Not a test on its own: the driver side of
/// `nixl_between_two_hosts_and_a_link_cut_mid_read`, run inside namespace A.
#[tokio::test]
#[ignore = "run by nixl_between_two_hosts_and_a_link_cut_mid_read"]
async fn two_hosts_nixl_driver() {
    let (rt, mut w, p, c) = two_hosts().await;
    let received = |c: &ConsumerHandle| c.received("nixl".to_string()).remote();
    let before = rt.get(received(&c)).await.unwrap();
    // Across the veth pair: the consumer's agent reads the producer's
    // memory on host B, over UCX's TCP, through the link: its 8 MiB come in
    // on host A's end (the control plane carries a few hundred bytes).
    let r = p.make(1.0, 2 << 20).transport(Transport::Nixl).remote();
    rt.wait(&r).await.unwrap();
    let rx = link_rx_bytes();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        (2u64 << 20) as f64
    );
    assert_eq!(
        rt.get(received(&c)).await.unwrap(),
        before + 1,
        "read over nixl"
    );
    let crossed = link_rx_bytes() - rx;
    assert!(crossed >= 8 << 20, "only {crossed} B came over the link");
    // Cut the link once the consumer has the read (delivered, not yet
    // acknowledged).
    let big = p.make(1.0, 256 << 20).transport(Transport::Nixl).remote();
    rt.wait(&big).await.unwrap();
    let call = c.sum(&big).remote();
    spin_until("the read delivered", 20, || rt.transfers_in_flight() > 0).await;
    let t0 = Instant::now();
    cut_link();
    let mid_read = rt.transfers_in_flight() > 0;
    match rt.get(&call).await {
        Ok(v) => {
            assert_eq!(v, (256u64 << 20) as f64, "if it finished, it is whole");
            println!(
                "the read ended before the cut took effect (in flight at the cut: {mid_read})"
            );
        }
        Err(e) => {
            let root = e.root_cause();
            assert!(
                matches!(root, Error::Transport(_) | Error::ActorDied { .. }),
                "{e}"
            );
            println!("the read failed after the cut: {e}");
        }
    }
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "the read ended {:?} after the cut",
        t0.elapsed()
    );
    host_b_is_gone(&rt, &p, &mut w, t0).await;
    // The consumer's agent still reads, from a producer on its own host.
    let p2 = rt.spawn::<Producer>(()).await.unwrap();
    let r2 = p2.make(2.0, 1000).transport(Transport::Nixl).remote();
    assert_eq!(rt.get(c.sum(&r2).remote()).await.unwrap(), 2000.0);
    drop((r, big, call, r2));
    rt.transfers_settled().await;
    assert_eq!(rt.transfers_in_flight(), 0);
    println!("TWO-HOSTS-OK");
}

/// TLS on the control link of a worker started by hand: it joins with the
/// certificate it trusts; a worker that tries plain TCP is refused.
#[tokio::test]
async fn tls_control_link() {
    deadline(60, async {
        rdt_integration_tests::logs();
        let ck = rcgen::generate_simple_self_signed(vec![
            "127.0.0.1".to_string(),
            "localhost".to_string(),
        ])
        .unwrap();
        let dir = std::env::temp_dir().join(format!("rdt-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, ck.cert.pem()).unwrap();
        let rt = Runtime::builder()
            .listen("127.0.0.1:0")
            .tls(ck.cert.pem(), ck.key_pair.serialize_pem())
            .spawn_timeout(Duration::from_secs(5))
            .start()
            .await
            .unwrap();
        let addr = rt.control_address().unwrap().to_string();
        // Plain TCP against a TLS listener: refused, and it exits.
        let plain = volunteer(&addr, &rt.join_token()).status().await.unwrap();
        assert!(!plain.success());
        let _w = volunteer(&addr, &rt.join_token())
            .env("RDT_TLS_CA", &ca)
            .spawn()
            .unwrap();
        let p = rt.spawn::<Producer>(()).on_joined_worker().await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        // Large values cross the encrypted link in both directions.
        let r = p.make(1.0, 4 << 20).remote();
        assert_eq!(
            rt.get(c.sum(&r).remote()).await.unwrap(),
            (4u64 << 20) as f64
        );
        assert!(!rt
            .get(p.is_kept(Tensor::full(1.0f32, &[1 << 20]), 0).remote())
            .await
            .unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    })
    .await;
}

/// Junk on the control port is dropped and logged; the runtime, its local
/// actors and later workers are undisturbed.
#[tokio::test]
async fn junk_on_the_control_port_is_dropped() {
    deadline(60, async {
        use tokio::io::AsyncWriteExt;
        rdt_integration_tests::logs();
        let rt = Runtime::builder()
            .listen("127.0.0.1:0")
            .start()
            .await
            .unwrap();
        let addr = rt.control_address().unwrap().to_string();
        let mut junk = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let _ = junk.write_all(&[0xAB; 4096]).await;
        let mut silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let _ = silent.write_all(b"GET / HTTP/1.1\r\n\r\n").await;
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        assert_eq!(
            rt.get(c.sum(Tensor::full(1.0f32, &[2])).remote())
                .await
                .unwrap(),
            2.0
        );
        let _w = volunteer(&addr, &rt.join_token()).spawn().unwrap();
        let p = rt.spawn::<Producer>(()).on_joined_worker().await.unwrap();
        assert_eq!(rt.get(p.echo(7).remote()).await.unwrap(), 7);
    })
    .await;
}

/// HB-1: bytes read are liveness. A joined worker whose heartbeat is far
/// shorter than one large frame takes to cross (1 GiB each way, a
/// heartbeat of 100 ms) stays alive and usable, in both directions. At
/// e05be92 only whole messages counted: the frame marked a healthy worker
/// dead.
#[tokio::test]
async fn hb_1_a_large_frame_slower_than_the_heartbeat_keeps_its_worker_alive() {
    deadline(120, async {
        rdt_integration_tests::logs();
        let rt = Runtime::builder()
            .listen("127.0.0.1:0")
            .heartbeat_timeout(Duration::from_millis(100))
            .start()
            .await
            .unwrap();
        let addr = rt.control_address().unwrap().to_string();
        let _w = volunteer(&addr, &rt.join_token()).spawn().unwrap();
        let p = rt.spawn::<Producer>(()).on_joined_worker().await.unwrap();
        let n = 1usize << 30;
        // Worker to driver.
        let t0 = std::time::Instant::now();
        let big: Tensor = rt.get(p.make_u8(n).remote()).await.unwrap();
        assert_eq!(big.numel(), n);
        let up = t0.elapsed();
        // Driver to worker.
        let t0 = std::time::Instant::now();
        let kept = rt.get(p.is_kept(big, 0).remote()).await.unwrap();
        assert!(!kept);
        let down = t0.elapsed();
        assert_eq!(rt.get(p.echo(1).remote()).await.unwrap(), 1);
        eprintln!("1 GiB up in {up:?}, down in {down:?}, heartbeat 100 ms");
        rt.shutdown().await;
    })
    .await
}
