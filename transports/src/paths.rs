//! Where a value's tensors sit: each tensor's *path* in the value (map
//! values by key, struct fields by name, sequence items by index), so that
//! a receiver can match an object's tensors to its own by name, whatever
//! order either side's containers iterate in (DESIGN §9: "targets are
//! matched by name, never by a container's iteration order").
//!
//! A path is its segments joined by `.`: `model.layers.3.mlp.up_proj.weight`
//! for the key `"model.layers.3.mlp.up_proj.weight"` of a map, `layers.3.w`
//! for field `w` of item 3 of field `layers` of a struct. A tensor that is
//! the whole value has the empty path. Enum variants are segments (their
//! name), `Option`'s `Some` and newtype structs are transparent.
//!
//! # Invariants
//! - PA-1: the walk visits a value exactly as serde serializes it, so
//!   [`tensor_paths`] and [`value::encode`](crate::value::encode) see the
//!   same tensors in the same order; [`object_paths`] gives, for each
//!   placeholder index of an encoded value, every path it sits at.
//! - PA-2: a value that holds a tensor below a map (in any depth) is
//!   *keyed* ([`Paths::keyed`]): the order of its tensors is the producer's
//!   map order, which no other process can know, so it must be matched by
//!   path, never by position.

use std::fmt::Display;

use serde::de::DeserializeOwned;
use serde::ser::{self, Serialize};

use crate::value::{ValueError, WALKING};
use crate::{dtype::DType, tensor::Tensor};

/// The paths of an encoded value's tensors (PA-1).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Paths {
    /// `(path, placeholder index)`, sorted by path. An index held at two
    /// paths (one tensor held twice) appears twice.
    pub by_path: Vec<(String, u32)>,
    /// PA-2: some tensor sits below a map.
    pub keyed: bool,
}

/// The tensors of `value` with their paths, in the order serde meets them
/// (a tensor held at two paths appears at both), and whether any is below
/// a map (PA-2). Nothing is copied: the tensors are clones of handles.
pub fn tensor_paths<T: Serialize + ?Sized>(
    value: &T,
) -> Result<(Vec<(String, Tensor)>, bool), ValueError> {
    let walk = walk(value)?;
    Ok((walk.found, walk.keyed))
}

/// The paths of the `count` tensors of an encoded value of type `T`
/// (`data`, as [`value::encode`](crate::value::encode) made it), found
/// by decoding it with stand-in tensors and walking the result.
pub fn object_paths<T>(data: &[u8], count: usize) -> Result<Paths, ValueError>
where
    T: Serialize + DeserializeOwned + 'static,
{
    // A weights list held in order: its indices, with no decode.
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<Vec<Tensor>>()
        && crate::value::is_tensors_in_order(data, count)
    {
        return Ok(in_order_paths(count));
    }
    // Stand-ins: one storage each, so that a walked tensor names its
    // index by its storage (a tensor held twice decodes as clones of one).
    let stand_ins: Vec<Tensor> = (0..count).map(|_| Tensor::zeros(DType::U8, &[0])).collect();
    let value: T = crate::value::decode(data, &stand_ins)?;
    let index: rustc_hash::FxHashMap<usize, u32> = stand_ins
        .iter()
        .enumerate()
        .map(|(i, t)| (t.storage_id(), i as u32))
        .collect();
    let walk = walk(&value)?;
    let mut by_path = Vec::with_capacity(walk.found.len());
    for (path, tensor) in walk.found {
        let Some(&i) = index.get(&tensor.storage_id()) else {
            return Err(ValueError::Serde(format!(
                "the value's tensor at `{path}` is not one of those it was decoded with"
            )));
        };
        by_path.push((path, i));
    }
    by_path.sort_unstable();
    Ok(Paths {
        by_path,
        keyed: walk.keyed,
    })
}

/// The paths of a `Vec<Tensor>` of `count` tensors held in order: their
/// indices (what [`object_paths`] finds for it, without the decode).
pub fn in_order_paths(count: usize) -> Paths {
    let mut by_path: Vec<(String, u32)> = (0..count).map(|i| (i.to_string(), i as u32)).collect();
    by_path.sort_unstable();
    Paths {
        by_path,
        keyed: false,
    }
}

/// What a walk found.
#[derive(Default)]
struct Walk {
    /// Each tensor met, with its path, in serde's order.
    found: Vec<(String, Tensor)>,
    /// PA-2.
    keyed: bool,
}

fn walk<T: Serialize + ?Sized>(value: &T) -> Result<Walk, ValueError> {
    /// Puts back the walk this one may run inside (a `Serialize` impl that
    /// walks another value), however this one ends.
    struct Restore(Option<Vec<Tensor>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0.take();
            WALKING.with(|w| *w.borrow_mut() = prev);
        }
    }
    let _restore = Restore(WALKING.with(|w| w.borrow_mut().replace(Vec::new())));
    let mut walker = Walker::default();
    value
        .serialize(&mut walker)
        .map_err(|e| ValueError::Serde(e.0))?;
    let tensors = WALKING
        .with(|w| w.borrow_mut().replace(Vec::new()))
        .unwrap_or_default();
    let mut found = Vec::with_capacity(walker.found.len());
    for (path, i) in walker.found {
        let t = tensors.get(i as usize).cloned().ok_or_else(|| {
            ValueError::Serde(format!("a placeholder at `{path}` that no tensor made"))
        })?;
        found.push((path, t));
    }
    Ok(Walk {
        found,
        keyed: walker.keyed,
    })
}

/// The error of a walk.
#[derive(Debug)]
struct WalkError(String);

impl Display for WalkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WalkError {}

impl ser::Error for WalkError {
    fn custom<M: Display>(msg: M) -> Self {
        WalkError(msg.to_string())
    }
}

/// A serde serializer that writes nothing: it follows the value's
/// structure and notes the path of each tensor placeholder.
#[derive(Default)]
struct Walker {
    segments: Vec<String>,
    /// How many of `segments` are map keys (PA-2).
    keys_deep: usize,
    /// The key of the map entry whose value comes next.
    key: Option<String>,
    found: Vec<(String, u32)>,
    keyed: bool,
}

impl Walker {
    fn path(&self) -> String {
        self.segments.join(".")
    }

    fn nested<T: Serialize + ?Sized>(
        &mut self,
        segment: String,
        is_key: bool,
        value: &T,
    ) -> Result<(), WalkError> {
        self.segments.push(segment);
        self.keys_deep += usize::from(is_key);
        let r = value.serialize(&mut *self);
        self.keys_deep -= usize::from(is_key);
        self.segments.pop();
        r
    }
}

/// A sequence, tuple or struct being walked, counting its items.
struct Items<'a> {
    walker: &'a mut Walker,
    next: usize,
}

impl Items<'_> {
    fn item<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), WalkError> {
        let i = self.next;
        self.next += 1;
        self.walker.nested(i.to_string(), false, value)
    }
}

macro_rules! nothing_inside {
    ($($f:ident: $t:ty),* $(,)?) => {
        $(fn $f(self, _: $t) -> Result<(), WalkError> { Ok(()) })*
    };
}

impl<'a> ser::Serializer for &'a mut Walker {
    type Ok = ();
    type Error = WalkError;
    type SerializeSeq = Items<'a>;
    type SerializeTuple = Items<'a>;
    type SerializeTupleStruct = Items<'a>;
    type SerializeTupleVariant = Items<'a>;
    type SerializeMap = &'a mut Walker;
    type SerializeStruct = &'a mut Walker;
    type SerializeStructVariant = &'a mut Walker;

    nothing_inside!(
        serialize_bool: bool, serialize_i8: i8, serialize_i16: i16, serialize_i32: i32,
        serialize_i64: i64, serialize_i128: i128, serialize_u8: u8, serialize_u16: u16,
        serialize_u32: u32, serialize_u64: u64, serialize_u128: u128, serialize_f32: f32,
        serialize_f64: f64, serialize_char: char, serialize_str: &str, serialize_bytes: &[u8],
        serialize_unit_struct: &'static str,
    );

    fn serialize_none(self) -> Result<(), WalkError> {
        Ok(())
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), WalkError> {
        value.serialize(self)
    }

    fn serialize_unit(self) -> Result<(), WalkError> {
        Ok(())
    }

    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
    ) -> Result<(), WalkError> {
        Ok(())
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        name: &'static str,
        value: &T,
    ) -> Result<(), WalkError> {
        if name == crate::value::PLACEHOLDER {
            let index = value.serialize(IndexOf)?;
            if self.keys_deep > 0 {
                self.keyed = true;
            }
            let path = self.path();
            self.found.push((path, index));
            return Ok(());
        }
        value.serialize(self)
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), WalkError> {
        self.nested(variant.to_string(), false, value)
    }

    fn serialize_seq(self, _: Option<usize>) -> Result<Items<'a>, WalkError> {
        Ok(Items {
            walker: self,
            next: 0,
        })
    }

    fn serialize_tuple(self, _: usize) -> Result<Items<'a>, WalkError> {
        self.serialize_seq(None)
    }

    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Items<'a>, WalkError> {
        self.serialize_seq(None)
    }

    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Items<'a>, WalkError> {
        // The variant's segment stays until `end`.
        self.segments.push(variant.to_string());
        Ok(Items {
            walker: self,
            next: 0,
        })
    }

    fn serialize_map(self, _: Option<usize>) -> Result<&'a mut Walker, WalkError> {
        Ok(self)
    }

    fn serialize_struct(self, _: &'static str, _: usize) -> Result<&'a mut Walker, WalkError> {
        Ok(self)
    }

    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<&'a mut Walker, WalkError> {
        // The variant's segment stays until `end`.
        self.segments.push(variant.to_string());
        Ok(self)
    }
}

impl ser::SerializeSeq for Items<'_> {
    type Ok = ();
    type Error = WalkError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), WalkError> {
        self.item(value)
    }
    fn end(self) -> Result<(), WalkError> {
        Ok(())
    }
}

impl ser::SerializeTuple for Items<'_> {
    type Ok = ();
    type Error = WalkError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), WalkError> {
        self.item(value)
    }
    fn end(self) -> Result<(), WalkError> {
        Ok(())
    }
}

impl ser::SerializeTupleStruct for Items<'_> {
    type Ok = ();
    type Error = WalkError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), WalkError> {
        self.item(value)
    }
    fn end(self) -> Result<(), WalkError> {
        Ok(())
    }
}

impl ser::SerializeTupleVariant for Items<'_> {
    type Ok = ();
    type Error = WalkError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), WalkError> {
        self.item(value)
    }
    fn end(self) -> Result<(), WalkError> {
        self.walker.segments.pop();
        Ok(())
    }
}

impl ser::SerializeMap for &mut Walker {
    type Ok = ();
    type Error = WalkError;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), WalkError> {
        self.key = Some(key.serialize(KeyText)?);
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), WalkError> {
        let key = self
            .key
            .take()
            .ok_or_else(|| WalkError("a map value came without its key".into()))?;
        self.nested(key, true, value)
    }
    fn end(self) -> Result<(), WalkError> {
        Ok(())
    }
}

impl ser::SerializeStruct for &mut Walker {
    type Ok = ();
    type Error = WalkError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
    ) -> Result<(), WalkError> {
        self.nested(name.to_string(), false, value)
    }
    fn end(self) -> Result<(), WalkError> {
        Ok(())
    }
}

impl ser::SerializeStructVariant for &mut Walker {
    type Ok = ();
    type Error = WalkError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
    ) -> Result<(), WalkError> {
        self.nested(name.to_string(), false, value)
    }
    fn end(self) -> Result<(), WalkError> {
        self.segments.pop();
        Ok(())
    }
}

/// Reads the `u32` inside a tensor placeholder.
struct IndexOf;

/// Writes a map key as the text of its path segment: strings as they are,
/// numbers, chars and booleans as they print, a unit variant by its name,
/// newtypes by what they hold. Other keys (a tuple, a struct) have no
/// one-segment name and fail the walk.
struct KeyText;

fn unsupported<T>(what: &str) -> Result<T, WalkError> {
    Err(WalkError(format!(
        "a map key that is {what} does not name a tensor's path (use strings, numbers or unit enum variants as keys)"
    )))
}

macro_rules! refuse_compound {
    ($ok:ty) => {
        type SerializeSeq = ser::Impossible<$ok, WalkError>;
        type SerializeTuple = ser::Impossible<$ok, WalkError>;
        type SerializeTupleStruct = ser::Impossible<$ok, WalkError>;
        type SerializeTupleVariant = ser::Impossible<$ok, WalkError>;
        type SerializeMap = ser::Impossible<$ok, WalkError>;
        type SerializeStruct = ser::Impossible<$ok, WalkError>;
        type SerializeStructVariant = ser::Impossible<$ok, WalkError>;
        fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, WalkError> {
            unsupported("a sequence")
        }
        fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, WalkError> {
            unsupported("a tuple")
        }
        fn serialize_tuple_struct(
            self,
            _: &'static str,
            _: usize,
        ) -> Result<Self::SerializeTupleStruct, WalkError> {
            unsupported("a tuple struct")
        }
        fn serialize_tuple_variant(
            self,
            _: &'static str,
            _: u32,
            _: &'static str,
            _: usize,
        ) -> Result<Self::SerializeTupleVariant, WalkError> {
            unsupported("a tuple variant")
        }
        fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, WalkError> {
            unsupported("a map")
        }
        fn serialize_struct(
            self,
            _: &'static str,
            _: usize,
        ) -> Result<Self::SerializeStruct, WalkError> {
            unsupported("a struct")
        }
        fn serialize_struct_variant(
            self,
            _: &'static str,
            _: u32,
            _: &'static str,
            _: usize,
        ) -> Result<Self::SerializeStructVariant, WalkError> {
            unsupported("a struct variant")
        }
    };
}

macro_rules! printed {
    ($($f:ident: $t:ty),* $(,)?) => {
        $(fn $f(self, v: $t) -> Result<String, WalkError> { Ok(v.to_string()) })*
    };
}

impl ser::Serializer for KeyText {
    type Ok = String;
    type Error = WalkError;
    refuse_compound!(String);

    printed!(
        serialize_bool: bool, serialize_i8: i8, serialize_i16: i16, serialize_i32: i32,
        serialize_i64: i64, serialize_i128: i128, serialize_u8: u8, serialize_u16: u16,
        serialize_u32: u32, serialize_u64: u64, serialize_u128: u128, serialize_f32: f32,
        serialize_f64: f64, serialize_char: char, serialize_str: &str,
    );

    fn serialize_bytes(self, v: &[u8]) -> Result<String, WalkError> {
        match std::str::from_utf8(v) {
            Ok(s) => Ok(s.to_string()),
            Err(_) => unsupported("bytes that are not UTF-8"),
        }
    }
    fn serialize_none(self) -> Result<String, WalkError> {
        unsupported("`None`")
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<String, WalkError> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<String, WalkError> {
        unsupported("`()`")
    }
    fn serialize_unit_struct(self, name: &'static str) -> Result<String, WalkError> {
        Ok(name.to_string())
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<String, WalkError> {
        Ok(variant.to_string())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<String, WalkError> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<String, WalkError> {
        unsupported("a newtype variant")
    }
}

macro_rules! not_an_index {
    ($($f:ident: $t:ty),* $(,)?) => {
        $(fn $f(self, _: $t) -> Result<u32, WalkError> { not_index() })*
    };
}

fn not_index<T>() -> Result<T, WalkError> {
    Err(WalkError("a tensor placeholder without its index".into()))
}

impl ser::Serializer for IndexOf {
    type Ok = u32;
    type Error = WalkError;
    refuse_compound!(u32);

    not_an_index!(
        serialize_bool: bool, serialize_i8: i8, serialize_i16: i16, serialize_i32: i32,
        serialize_i64: i64, serialize_u8: u8, serialize_u16: u16, serialize_u64: u64,
        serialize_f32: f32, serialize_f64: f64, serialize_char: char, serialize_str: &str,
        serialize_bytes: &[u8], serialize_unit_struct: &'static str,
    );

    fn serialize_u32(self, v: u32) -> Result<u32, WalkError> {
        Ok(v)
    }
    fn serialize_none(self) -> Result<u32, WalkError> {
        not_index()
    }
    fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<u32, WalkError> {
        not_index()
    }
    fn serialize_unit(self) -> Result<u32, WalkError> {
        not_index()
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
    ) -> Result<u32, WalkError> {
        not_index()
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: &T,
    ) -> Result<u32, WalkError> {
        not_index()
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<u32, WalkError> {
        not_index()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};

    use serde::{Deserialize, Serialize};

    use super::*;

    #[derive(Serialize, Deserialize)]
    struct Layer {
        w: Tensor,
        b: Option<Tensor>,
    }

    #[derive(Serialize, Deserialize)]
    struct Model {
        embed: Tensor,
        layers: Vec<Layer>,
        extra: BTreeMap<String, Tensor>,
        step: u64,
    }

    fn model() -> Model {
        Model {
            embed: Tensor::full(1.0f32, &[2]),
            layers: vec![
                Layer {
                    w: Tensor::full(2.0f32, &[2]),
                    b: None,
                },
                Layer {
                    w: Tensor::full(3.0f32, &[2]),
                    b: Some(Tensor::full(4.0f32, &[1])),
                },
            ],
            extra: [("norm".to_string(), Tensor::full(5.0f32, &[3]))].into(),
            step: 7,
        }
    }

    /// PA-1: a struct's tensors are named by field, item and key.
    #[test]
    fn pa_1_paths_follow_fields_items_and_keys() {
        let (found, keyed) = tensor_paths(&model()).unwrap();
        let paths: Vec<&str> = found.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "embed",
                "layers.0.w",
                "layers.1.w",
                "layers.1.b",
                "extra.norm"
            ]
        );
        assert!(keyed, "a tensor under a map makes the value keyed (PA-2)");
        assert_eq!(found[3].1.to_vec::<f32>().unwrap(), [4.0]);
    }

    /// PA-1: the paths of an encoded value name its placeholder indices,
    /// whatever order its map iterated in when it was encoded.
    #[test]
    fn pa_1_object_paths_name_the_encoded_indices() {
        let mut map = HashMap::new();
        for i in 0..16 {
            map.insert(format!("layer{i}"), Tensor::full(i as f32, &[1]));
        }
        let payload = crate::value::encode(&map).unwrap();
        let paths = object_paths::<HashMap<String, Tensor>>(&payload.data, 16).unwrap();
        assert!(paths.keyed);
        assert_eq!(paths.by_path.len(), 16);
        for (path, i) in &paths.by_path {
            let want: f32 = path.trim_start_matches("layer").parse().unwrap();
            assert_eq!(
                payload.tensors[*i as usize].to_vec::<f32>().unwrap(),
                [want]
            );
        }
    }

    /// PA-2: a struct or a list is positional, a tensor held twice has both
    /// of its paths, and a list held in order has its indices.
    #[test]
    fn pa_2_structs_and_lists_are_not_keyed() {
        let t = Tensor::full(1.0f32, &[1]);
        let value = (t.clone(), vec![t.clone(), Tensor::full(2.0f32, &[1])]);
        let payload = crate::value::encode(&value).unwrap();
        assert_eq!(payload.tensors.len(), 2);
        let paths = object_paths::<(Tensor, Vec<Tensor>)>(&payload.data, 2).unwrap();
        assert!(!paths.keyed);
        assert_eq!(
            paths.by_path,
            [("0".into(), 0), ("1.0".into(), 0), ("1.1".into(), 1)]
        );
        let list: Vec<Tensor> = (0..3).map(|i| Tensor::full(i as f32, &[1])).collect();
        let payload = crate::value::encode(&list).unwrap();
        assert_eq!(
            object_paths::<Vec<Tensor>>(&payload.data, 3).unwrap(),
            in_order_paths(3)
        );
    }

    #[test]
    fn a_key_that_is_no_name_fails_the_walk() {
        let map: HashMap<(u8, u8), Tensor> = [((1, 2), Tensor::full(1.0f32, &[1]))].into();
        let err = tensor_paths(&map).unwrap_err();
        assert!(
            err.to_string().contains("a map key that is a tuple"),
            "{err}"
        );
    }
}
