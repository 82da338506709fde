//! The ids a user sees: of objects, actors and collective groups, one
//! name each (floor 0: every module may name them).

/// Id of an object in the owner table.
pub type ObjectId = u64;

/// Driver-side id of an actor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ActorId(pub u64);

/// Identifies a collective group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupId(pub u64);

impl std::fmt::Display for GroupId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}
