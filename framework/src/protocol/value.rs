//! Values as they travel: a value's data and what its transport exported
//! for its tensors, the recent heads decoded once, and their wire forms.

use rdt_transport::{Blob, Exported};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::transport::Transport;
use rdt_transport::object_store;
use rdt_transport::value::Payload;

/// A value as it travels: serialized non-tensor part plus what the
/// transport exported for its tensors.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WireValue {
    /// postcard bytes with tensor placeholders (see [`data_wire`] for how
    /// a list of tensors travels).
    #[serde(with = "data_wire")]
    pub data: Blob,
    /// Transport that holds the tensors (`object_store` when there are none).
    pub transport: Transport,
    /// Metadata, handles or inline bytes of the tensors.
    pub exported: WireExported,
    /// Ids of the objects whose refs the value contains, once per
    /// occurrence: the driver holds a count on each while the value lives
    /// (CL-2).
    pub refs: Vec<u64>,
}

impl WireValue {
    /// Waits until every byte of the value is here: a receiver hands a
    /// value on while its large blobs still arrive (cut-through,
    /// `rdt_transport::wire::arriving`). The error says the bytes were lost on
    /// the way.
    pub async fn arrived(&self) -> Result<()> {
        for b in self.blobs() {
            b.arrived().await.map_err(lost_bytes)?;
        }
        Ok(())
    }

    /// Why its bytes will never all be here, if they won't.
    pub fn lost(&self) -> Option<Error> {
        self.blobs().find_map(Blob::lost).map(lost_bytes)
    }

    /// Every part of the value that may travel beside a frame's header.
    fn blobs(&self) -> impl Iterator<Item = &Blob> {
        [&self.data, &self.exported.head]
            .into_iter()
            .chain(&self.exported.inline)
    }

    /// The serialized non-tensor part; [`arrived`](Self::arrived) first.
    pub fn data_bytes(&self) -> Result<Bytes> {
        self.data.bytes().map_err(lost_bytes)
    }
}

/// What a transport exported for a value's tensors, as it travels.
///
/// The metadata and handles stay one run of encoded bytes until a process
/// that moves the tensors reads them ([`get`](Self::get), decoded once per
/// process and kept). The driver, which only forwards them to consumers,
/// never decodes them: for an object of 10 000 tensors that was a decode
/// and an encode of 10 000 entries on every pass. A large head travels
/// as a blob beside the frame's header (see [`head_wire`]), and the
/// inline bytes (object store) too.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct WireExported {
    /// postcard of the [`Exported`], its `inline` left empty.
    #[serde(with = "head_wire")]
    pub(super) head: Blob,
    /// [`Exported::inline`].
    pub inline: Vec<Blob>,
    /// [`Exported::nbytes`], for accounting without decoding.
    nbytes: u64,
    /// How many tensors it describes, for accounting without decoding.
    tensors: u32,
    /// The decoded form, once read in this process.
    #[serde(skip)]
    decoded: std::sync::OnceLock<Arc<Decoded>>,
}

/// A head decoded in this process, and the layout id it got then.
#[derive(Debug)]
struct Decoded {
    exported: Exported,
    /// Unique in this process, never reused: the same id means the same
    /// decode, hence the same bytes ([`WireExported::layout`]).
    layout: u64,
}

impl Decoded {
    fn new(exported: Exported) -> Arc<Decoded> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Arc::new(Decoded {
            exported,
            layout: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }
}

impl WireExported {
    /// The wire form of `exported` (encoded here, once).
    pub fn new(mut exported: Exported) -> Result<WireExported> {
        let inline = std::mem::take(&mut exported.inline);
        let head = postcard::to_allocvec(&exported).map_err(|e| Error::Decode {
            what: "a value's tensor metadata".into(),
            message: e.to_string(),
        })?;
        exported.inline = inline.clone();
        let nbytes = exported.nbytes() as u64;
        Ok(WireExported {
            head: Blob::new(Bytes::from(head)),
            inline,
            nbytes,
            tensors: exported.metas.len() as u32,
            decoded: std::sync::OnceLock::from(Decoded::new(exported)),
        })
    }

    /// The exported metadata, handles and inline bytes (decoded on first
    /// use in this process; a head decoded lately, by content, is not
    /// decoded again: see [`RecentHeads`]).
    ///
    /// A large head may still be arriving in a frame that is handed on as
    /// it arrives: await [`head_arrived`](Self::head_arrived) (or
    /// [`WireValue::arrived`]) first; before that this is an error.
    pub fn get(&self) -> Result<&Exported> {
        if let Some(d) = self.decoded.get() {
            return Ok(&d.exported);
        }
        let head = self.head.bytes().map_err(lost_bytes)?;
        let recent = match head.len() {
            _ if !self.inline.is_empty() => None,
            n if n >= RecentHeads::MIN_HEAD => Some(&RECENT_HEADS),
            n if n > 0 => Some(&RECENT_SMALL_HEADS),
            _ => None,
        };
        if let Some(recent) = recent {
            if let Some(d) = RecentHeads::find(recent, &head) {
                return Ok(&self.decoded.get_or_init(|| d).exported);
            }
        }
        // An empty head is `Default`'s: a value without tensors.
        let mut e: Exported = if head.is_empty() {
            Exported::default()
        } else {
            postcard::from_bytes(&head).map_err(|e| {
                Error::Protocol(format!(
                    "malformed tensor metadata in a value ({} bytes): {e}; the producer runs \
                     another rdt version, or the frame was damaged",
                    head.len()
                ))
            })?
        };
        e.inline = self.inline.clone();
        let d = Decoded::new(e);
        if let Some(recent) = recent {
            RecentHeads::keep(recent, head, d.clone());
        }
        Ok(&self.decoded.get_or_init(|| d).exported)
    }

    /// Waits until the head is all here (it is, unless it is large and
    /// came in a frame handed on as it arrives); an error if it never
    /// will be.
    pub async fn head_arrived(&self) -> Result<()> {
        self.head.arrived().await.map(drop).map_err(lost_bytes)
    }

    /// Is the head all here (it is, unless it is large and came in a
    /// frame handed on as it arrives)?
    pub fn head_is_here(&self) -> bool {
        self.head.still_arriving().is_none()
    }

    /// Names the decoded form [`get`](Self::get) gave, in this process:
    /// values whose heads were found among the recent ones share it, so
    /// the same layout means byte-identical metadata and handles, and an
    /// id is never reused. `None` before `get`. Transports key what they
    /// work out once per layout on it ([`rdt_transport::TransferCtx::layout`]).
    pub fn layout(&self) -> Option<u64> {
        self.decoded.get().map(|d| d.layout)
    }

    /// Total tensor bytes described.
    pub fn nbytes(&self) -> usize {
        self.nbytes as usize
    }

    /// How many tensors it describes (the head is not decoded for it).
    pub fn tensors(&self) -> usize {
        self.tensors as usize
    }
}

/// The heads a process decoded last, by content.
///
/// A weight sync passes the same parameters every step: a new object each
/// time, whose head (the tensors' metadata and the transport's handles,
/// nothing that names the object) is byte for byte the last one's.
/// Decoding the metadata of 10 000 tensors took about 220 µs of a
/// consumer's receive (one H100 host); finding it here is one comparison
/// of the bytes. A head's size says little of its tensors: the metadata
/// of 10 000 tensors of a few shapes is a few bytes (`metas_wire`), and
/// decoding still makes 10 000 entries, and a new layout would make the
/// transport work out its plan again. So every head of at least
/// [`MIN_HEAD`](Self::MIN_HEAD) bytes is kept, the last
/// [`KEEP`](Self::KEEP) of them; a hit compares every byte, so a head is
/// never taken for another. Smaller heads (a few tensors, no transport
/// handles) are kept apart, as many, so that a stream of small values
/// does not push a weight sync's head out: decoding one costs little
/// alone, but it is on a small pass's path before its receive starts
/// (the group's thread found a 4 KiB `nccl` tensor's head decoded 1.1 µs
/// after it started on it, 2×H200).
pub(crate) struct RecentHeads;

type Heads = rdt_transport::rt::recent::Recent<(Bytes, Arc<Decoded>)>;

impl RecentHeads {
    /// The smallest head kept with the large ones.
    pub(crate) const MIN_HEAD: usize = 64;
    /// Heads kept, of each size.
    pub(crate) const KEEP: usize = 8;

    /// The decoded form of `head`, if it was decoded lately.
    fn find(recent: &Heads, head: &Bytes) -> Option<Arc<Decoded>> {
        recent.find(|(h, _)| h == head).map(|(_, d)| d)
    }

    fn keep(recent: &Heads, head: Bytes, d: Arc<Decoded>) {
        recent.keep((head, d));
    }
}

static RECENT_HEADS: Heads = Heads::new(RecentHeads::KEEP);
static RECENT_SMALL_HEADS: Heads = Heads::new(RecentHeads::KEEP);

/// How a [`WireExported`]'s head travels: small ones inside the frame's
/// header, large ones as a blob beside it.
///
/// The head of an object of 10 000 tensors is about 100 KB. Inside the
/// header it was copied by the serializer into the header and again into
/// the frame on the sending side, and out of the read buffer and again
/// into its own buffer on the receiving side: about 30 µs to encode and
/// 30 µs to decode on the dev VM, on every pass through the driver. As a
/// blob it is written from the buffer it is in, and read into one buffer.
/// A small head stays in the header: one blob more would cost the tiny
/// calls a buffer of its own at each end.
pub(super) mod head_wire {
    use bytes::Bytes;
    use rdt_transport::Blob;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    /// Heads up to this size travel inside the header.
    pub(in crate::protocol) const INLINE_MAX: usize = 4096;

    #[derive(Serialize)]
    enum Out<'a> {
        Inline(&'a Bytes),
        Beside(&'a Blob),
    }

    #[derive(Deserialize)]
    enum In {
        Inline(Bytes),
        Beside(Blob),
    }

    pub(super) fn serialize<S: Serializer>(head: &Blob, s: S) -> Result<S::Ok, S::Error> {
        match head.bytes() {
            Ok(b) if b.len() <= INLINE_MAX => Out::Inline(&b).serialize(s),
            // Large, or still arriving (forwarded as it arrives).
            _ => Out::Beside(head).serialize(s),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Blob, D::Error> {
        Ok(match In::deserialize(d)? {
            In::Inline(b) => Blob::new(b),
            In::Beside(b) => b,
        })
    }
}

/// How a [`WireValue`]'s data travels: as its bytes (a blob), or, for a
/// value that is exactly its tensors in order (a `Vec<Tensor>` of at
/// least [`IN_ORDER_MIN`](rdt_transport::value::IN_ORDER_MIN), a
/// weights list), as their number.
///
/// The data of a list of 10 000 tensors is 10 000 placeholders, about
/// 20 KB, which the producer wrote to the driver and the driver to each
/// consumer on every pass (on the 2×H200 host all but 1 KB of the
/// delivery of such an object). The number is a few bytes; the receiving
/// process makes the same bytes again ([`in_order_data`]: once per count,
/// then shared), so nothing after the frame changes.
///
/// [`in_order_data`]: rdt_transport::value::in_order_data
mod data_wire {
    use rdt_transport::value::{in_order_data, tensors_in_order};
    use rdt_transport::Blob;
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize)]
    enum Out<'a> {
        Bytes(&'a Blob),
        TensorsInOrder(u64),
    }

    #[derive(Deserialize)]
    enum In {
        Bytes(Blob),
        TensorsInOrder(u64),
    }

    pub(super) fn serialize<S: Serializer>(data: &Blob, s: S) -> Result<S::Ok, S::Error> {
        // Still arriving (forwarded as it arrives): its bytes, as they come.
        match data.bytes().ok().and_then(|b| tensors_in_order(&b)) {
            Some(n) => Out::TensorsInOrder(n as u64).serialize(s),
            None => Out::Bytes(data).serialize(s),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Blob, D::Error> {
        Ok(match In::deserialize(d)? {
            In::Bytes(b) => b,
            In::TensorsInOrder(n) => Blob::new(
                usize::try_from(n)
                    .ok()
                    .and_then(in_order_data)
                    .ok_or_else(|| {
                        D::Error::custom(format!(
                            "a value of {n} tensors in order: more than {} tensors",
                            rdt_transport::MAX_TENSORS
                        ))
                    })?,
            ),
        })
    }
}

fn lost_bytes(e: rdt_transport::wire::arriving::ArriveError) -> Error {
    Error::Transport(rdt_transport::TransportError::new(
        rdt_transport::object_store::NAME,
        format!("a value's bytes did not arrive whole: {e}"),
    ))
}

/// A value with its tensors inline (object-store path).
pub(crate) fn inline_value(p: Payload, refs: Vec<u64>) -> Result<WireValue> {
    // CUDA tensors go through the host: copied device to host here, and
    // back to a device where they are received (object_store::unpack).
    let exported = object_store::pack(&p.tensors).map_err(|e| Error::Decode {
        what: "a tensor".into(),
        message: e.message,
    })?;
    Ok(WireValue {
        data: Blob::new(p.data),
        transport: Transport::ObjectStore,
        exported: WireExported::new(exported)?,
        refs,
    })
}
