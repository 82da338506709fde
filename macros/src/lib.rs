//! Procedural macros of rdt. Use them through the `rdt` crate:
//! `#[rdt::actor]`, `#[rdt::method(...)]`, `#[rdt::main]`.
//!
//! Generated code names only `::rdt::...` (its hidden `__private` module
//! re-exports what it needs), so users need no other dependency.
#![deny(missing_docs)]

mod expand;
mod parse;

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::quote;
use syn::spanned::Spanned;
use syn::{parse_macro_input, Item, ItemFn};

/// Marks an actor: put it on the struct (generates the typed handle
/// `<Name>Handle` and the worker bootstrap) and on its `impl` block
/// (generates dispatch, the handle's methods and the registration).
///
/// In the `impl` block, `fn new(args: A) -> Self` (or `-> Result<Self, E>`,
/// async or not, with zero or one argument) is the constructor run in the
/// worker; every method with a `self` receiver becomes a remote method.
///
/// Concurrency (on the impl block only): by default one call runs at a
/// time. `#[rdt::actor(max_concurrency = N)]` lets up to `N` calls of
/// `&self` methods interleave; `concurrency_groups(io = 2, compute = 4)`
/// declares groups with limits of their own, which a `&self` method joins
/// with `#[rdt::method(concurrency_group = "io")]`. A `&mut self` method
/// always runs alone.
#[proc_macro_attribute]
pub fn actor(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item = parse_macro_input!(item as Item);
    let out = match item {
        Item::Struct(s) if attr.is_empty() => expand::handle::actor_struct(s),
        Item::Struct(_) => Err(syn::Error::new(
            TokenStream2::from(attr).span(),
            "#[rdt::actor] on the struct takes no options; put `max_concurrency` and \
             `concurrency_groups` on the impl block's #[rdt::actor(...)]",
        )),
        Item::Impl(i) => {
            let mut opts = parse::ActorOptions::default();
            let parser = syn::meta::parser(|meta| opts.parse(meta));
            match syn::parse::Parser::parse(parser, attr) {
                Ok(()) => parse::actor_impl(i, &opts)
                    .and_then(|parsed| expand::dispatch::actor_impl(parsed, &opts)),
                Err(e) => Err(e),
            }
        }
        other => Err(syn::Error::new(
            other.span(),
            "#[rdt::actor] goes on an actor's struct and on its impl block",
        )),
    };
    out.unwrap_or_else(|e| e.to_compile_error()).into()
}

/// Options of a remote method, inside an `#[rdt::actor]` impl block:
/// `#[rdt::method(tensor_transport = "tcp")]` keeps the returned tensors in
/// the producing actor and moves them with that transport when the ref is
/// passed to another actor. A string names a built-in transport (checked
/// while compiling: object_store, tcp, shm, nccl, nixl, cuda_ipc); a path
/// names the `rdt::Transport` constant of a transport the program
/// registers itself (`tensor_transport = MY_TRANSPORT`).
/// `concurrency_group = "io"` runs a `&self` method in a group declared
/// with `#[rdt::actor(concurrency_groups(io = N))]`.
#[proc_macro_attribute]
pub fn method(_attr: TokenStream, item: TokenStream) -> TokenStream {
    let item2: TokenStream2 = item.into();
    let err = syn::Error::new(
        Span::call_site(),
        "#[rdt::method] only works on a method inside an #[rdt::actor] impl block",
    )
    .to_compile_error();
    quote!(#err #item2).into()
}

/// Turns `async fn main()` into a program whose re-executed copies become
/// rdt workers: calls `rdt::init()` first, then runs the body on a
/// multi-threaded tokio runtime.
#[proc_macro_attribute]
pub fn main(_attr: TokenStream, item: TokenStream) -> TokenStream {
    let f = parse_macro_input!(item as ItemFn);
    expand::main::main(f).into()
}
