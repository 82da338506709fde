//! The expansion of `#[rdt::main]`.

use proc_macro2::TokenStream as TokenStream2;
use quote::quote;
use syn::spanned::Spanned;
use syn::ItemFn;

/// `#[rdt::main]` on `f`: registers the binary's workers to boot in
/// `main`, calls `rdt::init()` first, then runs the body on tokio.
pub(crate) fn main(f: ItemFn) -> TokenStream2 {
    if f.sig.asyncness.is_none() {
        return syn::Error::new(
            f.sig.fn_token.span(),
            "#[rdt::main] needs an `async fn main`",
        )
        .to_compile_error();
    }
    let attrs = &f.attrs;
    let vis = &f.vis;
    let name = &f.sig.ident;
    let ret = &f.sig.output;
    let body = &f.block;
    quote! {
        // Workers of this binary boot in `main`, after Rust's start-up.
        const _: () = {
            #[::rdt::__private::linkme::distributed_slice(::rdt::__private::RDT_MAIN)]
            #[linkme(crate = ::rdt::__private::linkme)]
            static __RDT_HAS_MAIN: u8 = 1;
        };
        #(#attrs)*
        #vis fn #name() #ret {
            ::rdt::init();
            ::rdt::__private::tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .expect("rdt: could not build the tokio runtime")
                .block_on(async move #body)
        }
    }
}
