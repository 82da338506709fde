//! The protocol's tests: frames, heads, the handshake, in memory and over
//! socket pairs.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rdt_transport::wire::{self, FramePart};
use rdt_transport::{Blob, Exported};
use serde::Serialize;

use crate::error::Error;
use crate::transport::Transport;

use super::*;
use tokio::net::UnixStream;

fn order(args: Blob) -> ToWorker {
    ToWorker::Spawn(SpawnOrder {
        actor_type: "T".into(),
        worker: 1,
        name: "T#1".into(),
        max_frame: 1 << 30,
        tcp_bind: None,
        transfer_timeout_ms: 1000,
        hot_window_us: None,
        straight_large_values: None,
        log: crate::log::WorkerLog::default(),
        heartbeat_ms: None,
        args,
        id_space: actor_id_space(1),
        transports: vec![],
        peer_socket: None,
        device_map: rdt_transport::DeviceMap::new().map(
            rdt_transport::GpuUuid::from_bytes([7; 16]),
            rdt_transport::Place::Host,
        ),
    })
}

#[test]
fn actor_id_spaces_are_disjoint_from_each_other_and_from_the_driver() {
    let (a, b) = (actor_id_space(1), actor_id_space(2));
    assert!(a >> 63 == 1 && b >> 63 == 1, "the top bit marks actor ids");
    assert_eq!(b - a, 1 << 39, "half a trillion ids per actor");
    assert!(actor_id_space(0xFF_FFFF) > actor_id_space(0xFF_FFFE));
}

/// A sender and the receiver at the other end of a Unix socket pair,
/// both with the frame limit `max`.
fn connected(max: usize) -> (Sender, Receiver<UnixStream>) {
    let (a, b) = UnixStream::pair().unwrap();
    (
        spawn_writer(WriteHalf::Unix(a.into_split().1), max),
        Receiver::new(b, max),
    )
}

/// Reads one `Free` per object of `objects` from `rx`, in that order.
async fn expect_frees(rx: &mut Receiver<UnixStream>, objects: &[u64]) {
    for &want in objects {
        match rx.recv::<ToWorker>().await.unwrap() {
            Some(ToWorker::Free { object }) => assert_eq!(object, want),
            other => panic!("{other:?}"),
        }
    }
}

#[tokio::test]
async fn frames_round_trip_and_oversize_frames_are_refused() {
    tokio::time::timeout(Duration::from_secs(10), async {
        let (tx, mut rx) = connected(16 << 20);
        tx.send(&ToDriver::Pong).unwrap();
        assert!(matches!(
            rx.recv::<ToDriver>().await.unwrap(),
            Some(ToDriver::Pong)
        ));
        // A large frame goes out partly inline, partly from the queue,
        // and the next frame stays behind it.
        let big = Blob::new(bytes::Bytes::from(vec![7u8; 8 << 20]));
        tx.send(&order(big.clone())).unwrap();
        tx.send(&ToWorker::Shutdown).unwrap();
        match rx.recv::<ToWorker>().await.unwrap() {
            Some(ToWorker::Spawn(o)) => {
                // Handed up while its 8 MiB still arrive.
                assert!(o.args.still_arriving().is_some());
                rx.finish_frame().await.unwrap();
                assert_eq!(o.args, big)
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            rx.recv::<ToWorker>().await.unwrap(),
            Some(ToWorker::Shutdown)
        ));
        // Over the sender's limit: refused at once.
        let (c, _d) = UnixStream::pair().unwrap();
        let small = spawn_writer(WriteHalf::Unix(c.into_split().1), 1024);
        let e = small.send(&order(Blob::new(bytes::Bytes::from(vec![0u8; 4096]))));
        assert!(matches!(e, Err(Error::Protocol(m)) if m.contains("frame limit")));
        // Over the receiver's limit: an error, not an allocation.
        let (c, d) = UnixStream::pair().unwrap();
        let loose = spawn_writer(WriteHalf::Unix(c.into_split().1), 1 << 20);
        let mut strict = Receiver::new(d, 1024);
        loose
            .send(&order(Blob::new(bytes::Bytes::from(vec![0u8; 4096]))))
            .unwrap();
        assert!(strict.recv::<ToWorker>().await.is_err());
    })
    .await
    .unwrap();
}

/// A frame queued with `send_soon` costs no write: it goes out with the
/// next frame, before it, or from the writer task within `SOON`.
#[tokio::test]
async fn a_frame_sent_soon_goes_with_the_next_frame_or_on_its_own_soon() {
    tokio::time::timeout(Duration::from_secs(10), async {
        let (tx, mut rx) = connected(1 << 20);
        let mut deferred = Deferred::default();
        deferred.send_soon(&tx, free_frame(1)).unwrap();
        {
            let q = tx.inner.queue.lock();
            assert!(q.held && q.chunks.len() == 1, "held, not written");
        }
        tx.send(&ToWorker::Ping).unwrap();
        assert!(!tx.inner.queue.lock().held);
        deferred.flush();
        assert!(matches!(
            rx.recv::<ToWorker>().await.unwrap(),
            Some(ToWorker::Free { object: 1 })
        ));
        assert!(matches!(
            rx.recv::<ToWorker>().await.unwrap(),
            Some(ToWorker::Ping)
        ));
        // Alone, it still arrives (the writer task, after SOON).
        let mut deferred = Deferred::default();
        deferred.send_soon(&tx, free_frame(2)).unwrap();
        deferred.send_soon(&tx, free_frame(3)).unwrap();
        deferred.flush();
        expect_frees(&mut rx, &[2, 3]).await;
    })
    .await
    .expect("deadline");
}

fn free_frame(object: u64) -> wire::Frame {
    wire::to_frame_with_length(&ToWorker::Free { object }).unwrap()
}

/// A frame queued with `Deferred::send_soon` (the driver's lock) wakes
/// no writer then: the wake waits for `Deferred::flush`, and the frame
/// still arrives on its own.
#[tokio::test]
async fn a_frame_queued_soon_wakes_the_writer_after_the_flush() {
    tokio::time::timeout(Duration::from_secs(10), async {
        let (tx, mut rx) = connected(1 << 20);
        let mut deferred = Deferred::default();
        deferred.send_soon(&tx, free_frame(7)).unwrap();
        assert_eq!(
            deferred.soon.len(),
            1,
            "the writer's wake waits for the flush"
        );
        assert!(deferred.flush.is_empty(), "a held frame needs no flush");
        deferred.flush();
        expect_frees(&mut rx, &[7]).await;
    })
    .await
    .expect("deadline");
}

/// Two frames on one connection queued under the lock (a delivery and
/// its call): the second wakes no writer task, so nothing is written
/// before `Deferred::flush`, which writes both, in order. Were the
/// writer task woken, it would write them under the lock (and cost the
/// sender a wake-up).
#[tokio::test(flavor = "current_thread")]
async fn a_frame_behind_deferred_ones_waits_for_the_flush() {
    tokio::time::timeout(Duration::from_secs(10), async {
        let (tx, mut rx) = connected(1 << 20);
        let mut deferred = Deferred::default();
        deferred.send(&tx, free_frame(1)).unwrap();
        deferred.send(&tx, free_frame(2)).unwrap();
        deferred.send_soon(&tx, free_frame(3)).unwrap();
        assert_eq!(deferred.flush.len(), 1, "the connection is listed once");
        // Every task the sends woke runs during these yields (one
        // thread): a woken writer would write the frames now.
        for _ in 0..16 {
            tokio::task::yield_now().await;
        }
        {
            let mut recv = std::pin::pin!(rx.recv::<ToWorker>());
            assert!(
                futures::poll!(recv.as_mut()).is_pending(),
                "nothing is written before the flush"
            );
        }
        assert_eq!(tx.inner.queue.lock().chunks.len(), 3, "all still queued");
        deferred.flush();
        expect_frees(&mut rx, &[1, 2, 3]).await;
    })
    .await
    .expect("deadline");
}

/// A frame over the connection's limit is refused when queued, and the
/// frames queued before it still go out.
#[tokio::test]
async fn a_deferred_frame_over_the_limit_is_refused_and_loses_nothing() {
    tokio::time::timeout(Duration::from_secs(10), async {
        let (tx, mut rx) = connected(1 << 20);
        tx.set_max_frame(64);
        let mut deferred = Deferred::default();
        deferred.send(&tx, free_frame(1)).unwrap();
        let big = wire::to_frame_with_length(&vec![0u8; 1024]).unwrap();
        let err = deferred.send(&tx, big).unwrap_err();
        assert!(
            err.to_string().contains("exceeds the control frame limit"),
            "{err}"
        );
        deferred.flush();
        expect_frees(&mut rx, &[1]).await;
    })
    .await
    .expect("deadline");
}

/// A task handed to `Deferred::notify` hears it only at the flush.
#[tokio::test]
async fn a_deferred_notify_waits_for_the_flush() {
    tokio::time::timeout(Duration::from_secs(10), async {
        let task = Arc::new(tokio::sync::Notify::new());
        let mut deferred = Deferred::default();
        deferred.notify(&task);
        let mut heard = std::pin::pin!(task.notified());
        assert!(
            futures::poll!(heard.as_mut()).is_pending(),
            "not before the flush"
        );
        deferred.flush();
        heard.await;
    })
    .await
    .expect("deadline");
}

/// In a process that spins (hot window), a poll reads bytes tokio has
/// not seen yet (its I/O driver was not polled since they came): on
/// a current-thread runtime that never yielded, only the direct read
/// can find them.
#[tokio::test(flavor = "current_thread")]
async fn a_hot_poll_reads_bytes_tokio_has_not_seen() {
    use std::io::Write;
    use std::task::Poll;
    let window = rdt_transport::rt::hot::window();
    rdt_transport::rt::hot::set_window(Duration::from_millis(5));
    let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    b.set_nonblocking(true).unwrap();
    let b = UnixStream::from_std(b).unwrap();
    let mut rx = Receiver::new(ReadHalf::Unix(b.into_split().0), 1 << 20);
    let frame = wire::to_frame_with_length(&ToDriver::Pong).unwrap();
    assert!(frame.blobs.is_empty());
    a.write_all(&frame.head).unwrap();
    let before = DIRECT_READS.load(std::sync::atomic::Ordering::Relaxed);
    let polled = {
        let mut recv = std::pin::pin!(rx.recv::<ToDriver>());
        futures::poll!(recv.as_mut())
    };
    rdt_transport::rt::hot::set_window(window);
    assert!(
        matches!(polled, Poll::Ready(Ok(Some(ToDriver::Pong)))),
        "the first poll, before tokio saw the socket readable, found the frame"
    );
    assert!(DIRECT_READS.load(std::sync::atomic::Ordering::Relaxed) > before);
    // The end of the stream is read directly too, as an end.
    drop(a);
    let end = tokio::time::timeout(Duration::from_secs(10), rx.recv::<ToDriver>())
        .await
        .expect("deadline");
    assert!(matches!(end, Ok(None)));
}

#[tokio::test]
async fn a_cancelled_recv_resumes_the_frame_and_large_blobs_land_in_pooled_buffers() {
    use tokio::io::AsyncWriteExt;
    tokio::time::timeout(Duration::from_secs(10), async {
        let big = Blob::new(bytes::Bytes::from(
            (0..3 << 20).map(|i| (i % 251) as u8).collect::<Vec<u8>>(),
        ));
        let small = Blob::new(bytes::Bytes::from(vec![5u8; 100]));
        let msg = ToDriver::Fetched {
            req: 9,
            result: Ok(WireValue {
                data: small.clone(),
                transport: Transport::ObjectStore,
                exported: WireExported::new(Exported {
                    inline: vec![big.clone()],
                    ..Default::default()
                })
                .unwrap(),
                refs: vec![],
            }),
        };
        let frame = wire::to_frame(&msg).unwrap();
        let mut bytes = (frame.len() as u64).to_be_bytes().to_vec();
        bytes.extend_from_slice(&frame.head);
        for b in &frame.blobs {
            let FramePart::Here(b) = b else {
                panic!("all here")
            };
            bytes.extend_from_slice(b);
        }
        let (mut a, b) = tokio::io::duplex(8 << 20);
        let mut rx = Receiver::new(b, 64 << 20);
        let before = rdt_transport::host_pool::stats();
        // Half the frame, then a recv that gives up (cancelled) ...
        let half = bytes.len() / 2;
        a.write_all(&bytes[..half]).await.unwrap();
        let gave_up = tokio::time::timeout(Duration::from_millis(50), rx.recv::<ToDriver>()).await;
        assert!(gave_up.is_err(), "only half a frame was sent");
        // ... and the next recv finishes the same frame.
        a.write_all(&bytes[half..]).await.unwrap();
        let got = rx.recv::<ToDriver>().await.unwrap().unwrap();
        let ToDriver::Fetched {
            req: 9,
            result: Ok(v),
        } = got
        else {
            panic!("{got:?}")
        };
        assert_eq!(v.data, small);
        assert_eq!(v.exported.inline, vec![big]);
        // The large blob sits in a page-aligned pool buffer.
        assert_eq!(
            v.exported.inline[0].bytes().unwrap().as_ptr() as usize % 4096,
            0
        );
        let s = rdt_transport::host_pool::stats();
        // (Other tests of this binary use the pool too: at least one more.)
        assert!(s.misses + s.hits > before.misses + before.hits);
        // A clean end after the frame.
        drop(a);
        assert!(rx.recv::<ToDriver>().await.unwrap().is_none());
    })
    .await
    .unwrap();
}

/// A head as it arrives: encoded in another process, decoded here.
fn arrived(e: Exported) -> WireExported {
    let w = WireExported::new(e).unwrap();
    postcard::from_bytes(&postcard::to_stdvec(&w).unwrap()).unwrap()
}

fn metas(n: usize, numel: usize) -> Exported {
    Exported {
        metas: (0..n)
            .map(|_| rdt_transport::Tensor::zeros(rdt_transport::DType::F32, &[numel]).meta())
            .collect(),
        handles: vec![7; 8 * n],
        inline: Vec::new(),
    }
}

/// A frame's body in one buffer, as a socket carries it (every blob
/// here).
fn flat(frame: &wire::Frame) -> Vec<u8> {
    let mut bytes = frame.head.to_vec();
    for b in &frame.blobs {
        let FramePart::Here(b) = b else {
            panic!("every blob is here")
        };
        bytes.extend_from_slice(b);
    }
    bytes
}

#[test]
fn a_list_of_tensors_in_order_travels_as_its_count() {
    // A value with `data`, as a frame carries it, and back: the
    // frame's size and the data that came back.
    let round_trip = |data: Bytes| {
        let v = WireValue {
            data: Blob::new(data),
            transport: Transport::Nixl,
            exported: WireExported::new(metas(1, 1)).unwrap(),
            refs: Vec::new(),
        };
        let frame = wire::to_frame(&v).unwrap();
        let bytes = flat(&frame);
        let size = bytes.len();
        let back: WireValue = wire::from_frame(Bytes::from(bytes)).unwrap();
        (size, back.data.bytes().unwrap())
    };
    let weights: Vec<rdt_transport::Tensor> = (0..10_000)
        .map(|_| rdt_transport::Tensor::zeros(rdt_transport::DType::F32, &[1]))
        .collect();
    let data = rdt_transport::value::encode(&weights).unwrap().data;
    assert!(
        data.len() > 19_000,
        "10 000 placeholders: {} bytes",
        data.len()
    );
    let (size, back) = round_trip(data.clone());
    assert!(size < 200, "the frame carries the count: {size} bytes");
    assert_eq!(back, data, "the same data made again");
    // Forwarded as the driver does, what came back goes as its count
    // again.
    let (size, again) = round_trip(back.clone());
    assert!(size < 200, "forwarded: {size} bytes");
    assert_eq!(again, data);
    // Anything else travels as its bytes: a shorter list, the same
    // placeholders out of order, the list inside another value.
    let short = rdt_transport::value::encode(&weights[..63].to_vec())
        .unwrap()
        .data;
    let mut shuffled = data.to_vec();
    let last = shuffled.len() - 1;
    shuffled.swap(last - 1, last);
    let wrapped = rdt_transport::value::encode(&(7u8, weights.clone()))
        .unwrap()
        .data;
    for other in [short, Bytes::from(shuffled), wrapped] {
        let (size, back) = round_trip(other.clone());
        assert!(size > other.len(), "{size} bytes for {}", other.len());
        assert_eq!(back, other);
    }
}

#[test]
fn a_count_of_tensors_past_the_limit_is_malformed() {
    #[derive(Serialize)]
    enum Out {
        #[allow(dead_code)]
        Bytes(()),
        TensorsInOrder(u64),
    }
    #[derive(Serialize)]
    struct Forged {
        data: Out,
        transport: Transport,
        exported: WireExported,
        refs: Vec<u64>,
    }
    let forged = Forged {
        data: Out::TensorsInOrder(rdt_transport::MAX_TENSORS as u64 + 1),
        transport: Transport::Nixl,
        exported: WireExported::new(metas(1, 1)).unwrap(),
        refs: Vec::new(),
    };
    let bytes = flat(&wire::to_frame(&forged).unwrap());
    assert!(wire::from_frame::<WireValue>(Bytes::from(bytes)).is_err());
}

#[test]
fn a_large_head_travels_beside_the_header_and_a_small_one_inside() {
    // A value as a frame carries it, and back.
    let round_trip = |e: Exported| {
        let v = WireValue {
            data: Blob::new(Bytes::from_static(b"data")),
            transport: Transport::Nixl,
            exported: WireExported::new(e).unwrap(),
            refs: Vec::new(),
        };
        let frame = wire::to_frame(&v).unwrap();
        let blob_bytes: usize = frame.blobs.iter().map(|b| b.len()).sum();
        let bytes = flat(&frame);
        let back: WireValue = wire::from_frame(Bytes::from(bytes)).unwrap();
        (frame.head.len(), blob_bytes, back)
    };
    // 10 000 tensors: about 100 KB of head, outside the header.
    let (header, blobs, back) = round_trip(metas(10_000, 1024));
    assert!(header < 1024, "the header holds no head: {header} bytes");
    assert!(blobs > 50_000, "the head is a blob: {blobs} bytes of blobs");
    let e = back.exported.get().unwrap();
    assert_eq!(e.metas.len(), 10_000);
    assert_eq!(e.metas[9_999].shape.as_slice(), &[1024]);
    assert_eq!(e.handles, vec![7; 80_000]);
    // Two tensors: the head stays inside, the data is the one blob.
    let (header, blobs, back) = round_trip(metas(2, 4));
    assert!(header > 16 + 4 && header <= 16 + head_wire::INLINE_MAX);
    assert_eq!(blobs, 4, "only the data travels beside");
    assert_eq!(back.exported.get().unwrap().metas.len(), 2);
}

#[test]
fn a_head_decoded_lately_is_found_by_its_bytes() {
    // Two objects with the same head (the same parameters, two steps
    // of a weight sync): one decode.
    let (a, b) = (arrived(metas(300, 4)), arrived(metas(300, 4)));
    assert!(a.head.len() >= RecentHeads::MIN_HEAD);
    assert!(std::ptr::eq(a.get().unwrap(), b.get().unwrap()));
    // ... and one layout, which transports key their plans on.
    assert!(a.layout().is_some());
    assert_eq!(a.layout(), b.layout());
    // Another head (other shapes) is decoded on its own, and right,
    // with a layout of its own.
    let c = arrived(metas(300, 5));
    assert!(!std::ptr::eq(a.get().unwrap(), c.get().unwrap()));
    assert_eq!(c.get().unwrap().metas[0].shape.as_slice(), &[5]);
    assert_ne!(a.layout(), c.layout());
    // Small heads are kept apart: found by their bytes too, with one
    // layout (shapes no other test uses: the lists are the process's).
    let (d, e) = (arrived(metas(2, 4321)), arrived(metas(2, 4321)));
    assert!(d.head.len() < RecentHeads::MIN_HEAD);
    assert_eq!(d.layout(), None, "no layout before the head is read");
    assert!(std::ptr::eq(d.get().unwrap(), e.get().unwrap()));
    assert_eq!(d.layout(), e.layout());
    // A run of other small heads does not push a large one out.
    for n in 0..2 * RecentHeads::KEEP {
        arrived(metas(1, 5000 + n)).get().unwrap();
    }
    let f = arrived(metas(300, 4));
    assert!(std::ptr::eq(a.get().unwrap(), f.get().unwrap()));
}

#[test]
fn transports_travel_as_ids_and_an_unknown_id_is_an_error() {
    for t in Transport::registered() {
        let bytes = postcard::to_stdvec(&t).unwrap();
        assert_eq!(bytes.len(), 1, "{t} is one varint byte, not its name");
        assert_eq!(postcard::from_bytes::<Transport>(&bytes).unwrap(), t);
    }
    let e = postcard::from_bytes::<Transport>(&postcard::to_stdvec(&999u16).unwrap());
    assert!(e.is_err());
    // A transport the driver does not link in cannot be named.
    assert!(postcard::to_stdvec(&Transport::named("not_linked_anywhere")).is_err());
}

#[tokio::test]
async fn malformed_frame_is_an_error() {
    use tokio::io::AsyncWriteExt;
    tokio::time::timeout(Duration::from_secs(10), async {
        let (mut a, b) = tokio::io::duplex(1024);
        let mut rx = Receiver::new(b, 1024);
        a.write_all(&5u64.to_be_bytes()).await.unwrap();
        a.write_all(&[1, 2, 3, 4, 5]).await.unwrap();
        assert!(matches!(
            rx.recv::<ToWorker>().await,
            Err(Error::Protocol(_))
        ));
    })
    .await
    .unwrap();
}

/// A frame with one blob of `len` bytes, as its sender writes it
/// (length, head, blob), and the value it carries.
fn fetched_frame(len: usize) -> (Vec<u8>, Vec<u8>) {
    let blob: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
    let msg = ToDriver::Fetched {
        req: 1,
        result: Ok(WireValue {
            data: Blob::new(bytes::Bytes::from_static(b"d")),
            transport: Transport::ObjectStore,
            exported: WireExported::new(Exported {
                inline: vec![Blob::new(bytes::Bytes::from(blob.clone()))],
                ..Default::default()
            })
            .unwrap(),
            refs: vec![],
        }),
    };
    (flat(&wire::to_frame_with_length(&msg).unwrap()), blob)
}

/// The driver's hop of the object-store path, on real sockets: a
/// receiver (the driver's, from the producer) and a sender that
/// forwards what it got (to the consumer), and the consumer's receiver.
struct Relay {
    producer: tokio::net::UnixStream,
    from_producer: Receiver<ReadHalf>,
    to_consumer: Sender,
    at_consumer: Receiver<ReadHalf>,
}

fn relay() -> Relay {
    use tokio::net::UnixStream;
    let (producer, driver_in) = UnixStream::pair().unwrap();
    let (driver_out, consumer) = UnixStream::pair().unwrap();
    let (r, _w) = driver_in.into_split();
    std::mem::forget(_w);
    let (_r, w) = driver_out.into_split();
    std::mem::forget(_r);
    let (cr, cw) = consumer.into_split();
    std::mem::forget(cw);
    Relay {
        producer,
        from_producer: Receiver::new(ReadHalf::Unix(r), 1 << 30),
        to_consumer: spawn_writer(WriteHalf::Unix(w), 1 << 30),
        at_consumer: Receiver::new(ReadHalf::Unix(cr), 1 << 30),
    }
}

fn forward(v: WireValue) -> ToWorker {
    ToWorker::Deliver {
        object: 7,
        value: Ok(Delivery {
            value: v,
            from: None,
            xfer: 0,
            group: None,
            ack_at_landing: false,
        }),
    }
}

fn delivered(m: ToWorker) -> WireValue {
    match m {
        ToWorker::Deliver { value: Ok(d), .. } => d.value,
        other => panic!("{other:?}"),
    }
}

fn fetched(m: ToDriver) -> WireValue {
    match m {
        ToDriver::Fetched { result: Ok(v), .. } => v,
        other => panic!("{other:?}"),
    }
}

/// The producer's side: writes the first `half` of `bytes`, then, when
/// told, the rest (`true`: a producer that finishes) or nothing
/// (`false`: one that dies mid-blob), and closes its socket.
fn produce(
    producer: tokio::net::UnixStream,
    bytes: Vec<u8>,
    half: usize,
) -> (
    tokio::sync::oneshot::Sender<bool>,
    tokio::task::JoinHandle<()>,
) {
    use tokio::io::AsyncWriteExt;
    let (tell, told) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut producer = producer;
        producer.write_all(&bytes[..half]).await.unwrap();
        if told.await.unwrap_or(false) {
            producer.write_all(&bytes[half..]).await.unwrap();
        }
    });
    (tell, task)
}

#[tokio::test]
async fn a_large_blob_is_handed_up_and_forwarded_while_it_arrives() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let Relay {
            producer,
            mut from_producer,
            to_consumer,
            mut at_consumer,
        } = relay();
        let len = 3 * STREAM_MIN;
        let (bytes, blob) = fetched_frame(len);
        // The head and the first half of the blob, then the rest when
        // told.
        let half = bytes.len() - len / 2;
        let (more, producer) = produce(producer, bytes, half);
        let v = fetched(from_producer.recv().await.unwrap().unwrap());
        let at_driver = v.exported.inline[0].clone();
        assert!(
            at_driver.still_arriving().is_some(),
            "handed up before the blob is in"
        );
        // Forwarded before it is whole; the driver's reader goes on.
        to_consumer.send(&forward(v)).unwrap();
        let reader = tokio::spawn(async move {
            let r = from_producer.recv::<ToDriver>().await;
            (from_producer, r)
        });
        let v = delivered(at_consumer.recv::<ToWorker>().await.unwrap().unwrap());
        let at_consumer_blob = v.exported.inline[0].clone();
        let consumer_reader = tokio::spawn(async move {
            at_consumer.finish_frame().await.unwrap();
            at_consumer
        });
        // The consumer gets bytes while the driver's copy is not whole:
        // cut-through, not store-and-forward.
        let arriving = at_consumer_blob.still_arriving().unwrap().clone();
        let mut seen = 0;
        while seen < len / 4 {
            match arriving.progress_beyond(seen).await {
                rdt_transport::wire::arriving::Progress::Filling(n) => seen = n,
                p => panic!("ended early: {p:?}"),
            }
        }
        assert!(at_driver.still_arriving().is_some());
        assert_eq!(arriving.prefix(seen), &blob[..seen]);
        let (_, early) = to_consumer.forwarded();
        assert!(early >= seen as u64 / 2, "sent before whole: {early}");
        // The rest: both ends become whole, with the right bytes.
        more.send(true).unwrap();
        producer.await.unwrap();
        assert_eq!(&at_driver.arrived().await.unwrap()[..], &blob[..]);
        assert_eq!(&at_consumer_blob.arrived().await.unwrap()[..], &blob[..]);
        let mut at_consumer = consumer_reader.await.unwrap();
        // Both connections go on: a clean end at the driver (the
        // producer closed its socket), the next frame at the consumer.
        let (_, end) = reader.await.unwrap();
        assert!(end.unwrap().is_none());
        to_consumer.send(&ToWorker::Ping).unwrap();
        assert!(matches!(
            at_consumer.recv::<ToWorker>().await.unwrap(),
            Some(ToWorker::Ping)
        ));
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_blob_cut_off_at_its_source_is_lost_downstream_and_the_connection_goes_on() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let Relay {
            producer,
            mut from_producer,
            to_consumer,
            mut at_consumer,
        } = relay();
        let len = 2 * STREAM_MIN;
        let (bytes, _) = fetched_frame(len);
        let half = bytes.len() - len / 2;
        let (die, producer) = produce(producer, bytes, half);
        let v = fetched(from_producer.recv().await.unwrap().unwrap());
        let at_driver = v.clone();
        to_consumer.send(&forward(v)).unwrap();
        // The producer dies mid-blob.
        die.send(false).unwrap();
        assert!(from_producer.recv::<ToDriver>().await.is_err());
        producer.await.unwrap();
        drop(from_producer);
        let e = at_driver.arrived().await.unwrap_err().to_string();
        assert!(e.contains("stopped after"), "{e}");
        assert!(at_driver.lost().is_some());
        // The consumer gets the frame (padded) and a status that says
        // its bytes are lost: the value fails, it is never used.
        let v = delivered(at_consumer.recv::<ToWorker>().await.unwrap().unwrap());
        let reader = tokio::spawn(async move {
            let next = at_consumer.recv::<ToWorker>().await;
            (at_consumer, next)
        });
        let e = v.arrived().await.unwrap_err().to_string();
        assert!(e.contains("lost on the way"), "{e}");
        // The connection stays in step: the next frame arrives whole.
        to_consumer.send(&ToWorker::Ping).unwrap();
        let (_, next) = reader.await.unwrap();
        assert!(matches!(next.unwrap(), Some(ToWorker::Ping)));
    })
    .await
    .unwrap();
}
#[tokio::test]
async fn a_stalled_source_gives_up_its_forward_after_the_limit_and_frees_the_connection() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let Relay {
            producer,
            mut from_producer,
            to_consumer,
            mut at_consumer,
        } = relay();
        to_consumer.set_stall_limit(Duration::from_millis(300));
        let len = 2 * STREAM_MIN;
        let (bytes, blob) = fetched_frame(len);
        let half = bytes.len() - len / 2;
        // The producer stops mid-blob (stopped, not dead: its socket
        // stays open), and goes on only when told.
        let (more, producer) = produce(producer, bytes, half);
        let v = fetched(from_producer.recv().await.unwrap().unwrap());
        let at_driver = v.exported.inline[0].clone();
        let reader = tokio::spawn(async move {
            let r = from_producer.recv::<ToDriver>().await;
            (from_producer, r)
        });
        to_consumer.send(&forward(v)).unwrap();
        let t0 = std::time::Instant::now();
        // The consumer's copy fails once no byte came for the limit...
        let v = delivered(at_consumer.recv::<ToWorker>().await.unwrap().unwrap());
        let consumer_reader = tokio::spawn(async move {
            let next = at_consumer.recv::<ToWorker>().await;
            (at_consumer, next)
        });
        let e = v.arrived().await.unwrap_err().to_string();
        assert!(e.contains("stopped coming"), "{e}");
        assert!(
            t0.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t0.elapsed()
        );
        // ...and the connection to it goes on while the producer is
        // still stopped.
        to_consumer.send(&ToWorker::Ping).unwrap();
        let (_, next) = consumer_reader.await.unwrap();
        assert!(matches!(next.unwrap(), Some(ToWorker::Ping)));
        assert!(at_driver.still_arriving().is_some());
        // The driver's own copy is untouched: whole once the producer
        // goes on.
        more.send(true).unwrap();
        producer.await.unwrap();
        assert_eq!(&at_driver.arrived().await.unwrap()[..], &blob[..]);
        let (_, end) = reader.await.unwrap();
        assert!(end.unwrap().is_none());
    })
    .await
    .unwrap();
}
