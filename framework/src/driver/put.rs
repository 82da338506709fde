//! Putting values into the owner table: `put` and `put_with`.

use super::*;

impl Runtime {
    /// Stores `value` in the driver (object-store path) and returns a ref to
    /// it, to pass to any actor. See [`Runtime::put_with`] for a direct
    /// transport.
    pub fn put<T: Serialize>(&self, value: &T) -> Result<ObjectRef<T>> {
        crate::refs::api::put(self, value)
    }

    /// [`put`](Self::put) of a value encoded already.
    pub(super) fn put_encoded<T>(
        &self,
        encoded: crate::refs::client::Encoded,
    ) -> Result<ObjectRef<T>> {
        let wv = inline_value(encoded.payload.clone(), encoded.ref_ids())?;
        // The value travels in a delivery to every consumer: check the
        // size of that whole frame, not of the value alone (OW-6).
        let probe = ToWorker::Deliver {
            object: u64::MAX,
            value: Ok(protocol::Delivery {
                value: wv,
                from: None,
                xfer: 0,
                group: None,
                ack_at_landing: false,
            }),
        };
        let size = rdt_transport::wire::to_frame(&probe)
            .map_err(|e| Error::Protocol(e.to_string()))?
            .len();
        if size > self.inner.config.max_frame_bytes {
            return Err(Error::Protocol(format!(
                "a value put by the driver travels in a {size}-byte message, over the control frame limit of {} bytes; raise RuntimeBuilder::max_frame_bytes or return the tensors from an actor method with a direct transport",
                self.inner.config.max_frame_bytes
            )));
        }
        let ToWorker::Deliver { value: Ok(d), .. } = probe else {
            unreachable!("built above")
        };
        let wv = d.value;
        let id = self.inner.next_id();
        self.inner
            .state
            .lock()
            .table
            .insert_done(id, None, ObjState::Ready(wv));
        // CL-2: the table holds the refs in the value now.
        drop(encoded);
        Ok(ObjectRef::adopt(id, self.inner.clone() as SharedClient))
    }

    /// Stores `value` in the driver, its tensors over `transport`, and
    /// returns a ref to pass to any actor. With [`Transport::ObjectStore`]
    /// this is [`Runtime::put`]; with a one-sided transport that serves the
    /// driver (`nixl`), the tensors stay in this process, registered, and
    /// each consumer reads them directly. They live until the last ref and
    /// call that needs them are gone.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while the tensors are exported (`nixl` registers
    /// them) returns no ref; what the export registered stays until the
    /// transport is dropped. Drop it only once it returned.
    pub async fn put_with<T: Serialize>(
        &self,
        value: &T,
        transport: Transport,
    ) -> Result<ObjectRef<T>> {
        crate::refs::api::put_with(self, value, transport).await
    }

    /// [`put_with`](Self::put_with) over a transport other than the object
    /// store.
    pub(super) async fn put_exported<T: Serialize>(
        &self,
        value: &T,
        transport: Transport,
    ) -> Result<ObjectRef<T>> {
        let refuse = || Error::TransportUnavailable {
            name: transport.name().into(),
            reason: "the driver cannot hold objects on it: put_with takes Transport::Nixl (a \
                     one-sided transport that serves the driver) or Transport::ObjectStore"
                .into(),
        };
        if transport.sidedness() != rdt_transport::Sidedness::OneSided {
            return Err(refuse());
        }
        let inst = transport.instance()?;
        if !inst.serves_driver() {
            return Err(refuse());
        }
        let encoded = crate::refs::api::encode(value, "put_with")?;
        let refs = encoded.ref_ids();
        let payload = encoded.payload.clone();
        for t in &payload.tensors {
            inst.check_device(t.device())?;
        }
        let id = self.inner.next_id();
        let exported = match inst.export(id, &payload.tensors).await {
            Ok(x) => x,
            Err(e) => {
                let _ = inst.release(id).await;
                return Err(e.into());
            }
        };
        // Nothing awaits from the export to `insert_held`, which hands the
        // registration to the table: a cancelled call drops the export's
        // own guards, and an error here releases what it made.
        let exported = match WireExported::new(exported) {
            Ok(x) => x,
            Err(e) => {
                let _ = inst.release(id).await;
                return Err(e);
            }
        };
        let wv = WireValue {
            data: Blob::new(payload.data),
            transport,
            exported,
            refs,
        };
        let held = crate::owner::DriverHeld::new(id, payload.tensors, inst);
        self.inner
            .state
            .lock()
            .table
            .insert_held(id, transport, wv, held);
        drop(encoded);
        Ok(ObjectRef::adopt(id, self.inner.clone() as SharedClient))
    }
}
