//! The trainer's side: [`Publisher`] hands out a buffer no reader holds,
//! and publishes it as a version (WS-3, WS-4).

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::layout::{Layout, LayoutDigest};
use super::params::ParamSet;
use crate::refs::object_ref::ObjectRef;
use crate::{Error, Result, Tensor, Transport};

/// What a version's object holds: its number and its arenas.
#[derive(Serialize, Deserialize)]
pub struct Snapshot {
    /// The version.
    pub version: u64,
    /// The arenas of the buffer it was published from.
    pub arenas: Vec<Tensor>,
}

/// One published version, to pass to every subscriber: small (no tensor
/// in it), and cloned freely. Its `weights` ref keeps the version's
/// buffer from being written again until every clone of it is dropped
/// (and every receive of it ended): drop it once every subscriber got it,
/// keeping the newest for late joiners.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Published {
    /// The version, increasing from one publish to the next.
    pub version: u64,
    /// The digest of the layout it was published with.
    pub digest: LayoutDigest,
    /// Bytes of its arenas.
    pub bytes: u64,
    /// The version's object: its arenas, exported once over the
    /// publisher's transport whatever the number of subscribers.
    pub weights: ObjectRef<Snapshot>,
}

/// What a publish cost the trainer.
#[derive(Clone, Copy, Debug, Default)]
pub struct PublishStats {
    /// Buffers this publisher made in all (the first included): more than
    /// two means slow readers held versions while newer ones came.
    pub buffers: usize,
    /// Versions published (one export each).
    pub exports: u64,
    /// The staging copy of the last [`Publisher::publish_copy`] (zero for
    /// [`Publisher::publish`]).
    pub copy: Duration,
    /// The export of the last publish.
    pub export: Duration,
}

/// The trainer's side of a weight sync: a ring of [`ParamSet`] buffers of
/// one layout, each published as a version and written again only once
/// no reader holds it.
///
/// - **Never blocked by a reader** (WS-3): [`next_buffer`](Self::next_buffer)
///   returns a buffer no reader holds, making a new one when every buffer
///   is still held (a slow reader costs memory, never time).
/// - **Snapshots** (WS-4): a version's buffer is not handed out again
///   while anything holds that version (a [`Published`] or its `weights`
///   ref anywhere, a receive under way): its readers never see the bytes
///   of a later version.
/// - **One export per version**: the version's object is put once, over
///   the publisher's transport; every subscriber receives from that one
///   export (`shm` and `nixl` readers read the same memory; `tcp` sends
///   to each).
///
/// Two ways to publish: write the next version into
/// [`next_buffer`](Self::next_buffer) and [`publish`](Self::publish) it
/// (double-buffered: no copy), or keep training in your own parameters
/// and [`publish_copy`](Self::publish_copy) them (one copy per version,
/// into a buffer no reader holds).
///
/// Used inside an actor method (it exports through the actor's runtime).
pub struct Publisher {
    layout: Layout,
    digest: LayoutDigest,
    transport: Transport,
    buffers: Vec<ParamSet>,
    last: Option<u64>,
    stats: PublishStats,
}

impl Publisher {
    /// A publisher of `first`'s layout over `transport`, with `first` as
    /// its first buffer (more are made like it: [`ParamSet::empty_like`]).
    pub fn new(first: ParamSet, transport: Transport) -> Publisher {
        Publisher {
            layout: first.layout().clone(),
            digest: first.layout().digest(),
            transport,
            buffers: vec![first],
            last: None,
            stats: PublishStats {
                buffers: 1,
                ..PublishStats::default()
            },
        }
    }

    /// The layout every version has (send it to a subscriber once:
    /// [`Subscriber::subscribe`](super::Subscriber::subscribe)).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The last version published.
    pub fn version(&self) -> Option<u64> {
        self.last
    }

    /// What publishing has cost so far.
    pub fn stats(&self) -> PublishStats {
        self.stats
    }

    /// A buffer no reader holds, to write the next version into: the
    /// oldest free one, or a new one (zeroed) when every buffer is held.
    /// Never waits.
    pub fn next_buffer(&mut self) -> Result<ParamSet> {
        if let Some(b) = self.buffers.iter().find(|b| !held(b)) {
            return Ok(b.clone());
        }
        let fresh = self.buffers[0].empty_like()?;
        self.buffers.push(fresh.clone());
        self.stats.buffers += 1;
        metrics::counter!("rdt_weights_buffers_made").increment(1);
        Ok(fresh)
    }

    /// Publishes `buffer` (one of [`next_buffer`](Self::next_buffer)'s) as
    /// `version`, which must be greater than the last one.
    ///
    /// # Cancel safety
    ///
    /// As [`ActorRuntime::put_with`](crate::ActorRuntime::put_with): drop
    /// it only once it returned.
    pub async fn publish(&mut self, version: u64, buffer: &ParamSet) -> Result<Published> {
        self.check_newer(version)?;
        if !self.buffers.iter().any(|b| b.same_buffer(buffer)) {
            return Err(Error::Protocol(
                "Publisher::publish takes a buffer from Publisher::next_buffer; to publish other parameters, use publish_copy".into(),
            ));
        }
        let started = Instant::now();
        let snapshot = Snapshot {
            version,
            arenas: buffer.arenas().to_vec(),
        };
        let weights = crate::runtime().put_with(&snapshot, self.transport).await?;
        self.stats.export = started.elapsed();
        self.stats.exports += 1;
        self.last = Some(version);
        metrics::counter!("rdt_weights_published", "transport" => self.transport.name())
            .increment(1);
        Ok(Published {
            version,
            digest: self.digest,
            bytes: buffer.nbytes() as u64,
            weights,
        })
    }

    /// Copies `params` (a set of this layout: the trainer's own, which it
    /// goes on training) into a buffer no reader holds and publishes it
    /// as `version`.
    ///
    /// # Cancel safety
    ///
    /// As [`publish`](Self::publish).
    pub async fn publish_copy(&mut self, version: u64, params: &ParamSet) -> Result<Published> {
        self.check_newer(version)?;
        let started = Instant::now();
        let buffer = self.next_buffer()?;
        buffer.copy_from(params)?;
        buffer.ready().await?;
        let copy = started.elapsed();
        let published = self.publish(version, &buffer).await?;
        self.stats.copy = copy;
        Ok(published)
    }
}

impl Publisher {
    /// WS-5 on the trainer's side: `version` is greater than the last one
    /// published.
    fn check_newer(&self, version: u64) -> Result<()> {
        match self.last.filter(|&l| version <= l) {
            Some(current) => Err(Error::StaleVersion { version, current }),
            None => Ok(()),
        }
    }
}

/// Does any object of this worker's store hold `buffer`'s arenas (a
/// published version not yet freed)?
fn held(buffer: &ParamSet) -> bool {
    buffer.arenas().iter().any(crate::worker::tensor_held)
}
