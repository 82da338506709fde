//! The expansion of an actor's struct: its typed handle and the worker
//! bootstrap.

use proc_macro2::TokenStream as TokenStream2;
use quote::{format_ident, quote};
use syn::spanned::Spanned;
use syn::ItemStruct;

/// `#[rdt::actor]` on the struct.
pub(crate) fn actor_struct(s: ItemStruct) -> syn::Result<TokenStream2> {
    if !s.generics.params.is_empty() {
        return Err(syn::Error::new(
            s.generics.span(),
            "rdt actors cannot be generic",
        ));
    }
    let name = &s.ident;
    let vis = &s.vis;
    let handle = format_ident!("{}Handle", name);
    let doc = format!("Typed client handle of the [`{name}`] actor: each remote method returns an [`rdt::Call`] to submit with `.remote()`.");
    Ok(quote! {
        #s

        #[doc = #doc]
        #[derive(Clone, Debug)]
        #vis struct #handle {
            raw: ::rdt::__private::RawHandle,
        }

        impl ::core::convert::From<::rdt::__private::RawHandle> for #handle {
            fn from(raw: ::rdt::__private::RawHandle) -> Self {
                #handle { raw }
            }
        }

        // A handle is an argument or a return value like any other: the
        // actor that receives it calls the same actor.
        impl ::rdt::__private::serde::Serialize for #handle {
            fn serialize<S: ::rdt::__private::serde::Serializer>(&self, s: S) -> ::core::result::Result<S::Ok, S::Error> {
                ::rdt::__private::serde::Serialize::serialize(&self.raw, s)
            }
        }

        impl<'de> ::rdt::__private::serde::Deserialize<'de> for #handle {
            fn deserialize<D: ::rdt::__private::serde::Deserializer<'de>>(d: D) -> ::core::result::Result<Self, D::Error> {
                <::rdt::__private::RawHandle as ::rdt::__private::serde::Deserialize<'de>>::deserialize(d)
                    .map(|raw| #handle { raw })
            }
        }

        #[allow(dead_code)]
        impl #handle {
            /// The actor's id (for collective groups and logs).
            pub fn id(&self) -> ::rdt::ActorId {
                self.raw.id()
            }
            /// The actor's name.
            pub fn name(&self) -> &str {
                self.raw.name()
            }
            /// Kills the actor's process.
            pub fn kill(&self) {
                self.raw.kill()
            }
            /// The worker's process id.
            pub fn pid(&self) -> ::core::option::Option<u32> {
                self.raw.pid()
            }
            /// The untyped handle.
            pub fn raw(&self) -> &::rdt::RawHandle {
                &self.raw
            }
        }

        ::rdt::__private::worker_bootstrap!();
    })
}
