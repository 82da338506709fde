//! Procedural macros of rdt. Use them through the `rdt` crate:
//! `#[rdt::actor]`, `#[rdt::method(...)]`, `#[rdt::main]`.
//!
//! Generated code names only `::rdt::...` (its hidden `__private` module
//! re-exports what it needs), so users need no other dependency.
#![deny(missing_docs)]

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{
    parse_macro_input, FnArg, ImplItem, Item, ItemFn, ItemImpl, ItemStruct, LitStr, Pat,
    ReturnType, Type,
};

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
        Item::Struct(s) if attr.is_empty() => actor_struct(s),
        Item::Struct(_) => Err(syn::Error::new(
            TokenStream2::from(attr).span(),
            "#[rdt::actor] on the struct takes no options; put `max_concurrency` and \
             `concurrency_groups` on the impl block's #[rdt::actor(...)]",
        )),
        Item::Impl(i) => {
            let mut opts = ActorOptions::default();
            let parser = syn::meta::parser(|meta| opts.parse(meta));
            match syn::parse::Parser::parse(parser, attr) {
                Ok(()) => actor_impl(i, opts),
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

/// `#[rdt::actor(max_concurrency = N, concurrency_groups(name = N, ..))]`
/// on the impl block.
#[derive(Default)]
struct ActorOptions {
    max_concurrency: Option<u32>,
    groups: Vec<(syn::Ident, u32)>,
}

fn parse_limit(lit: &syn::LitInt, what: &str) -> syn::Result<u32> {
    let n: u32 = lit.base10_parse()?;
    if n == 0 {
        return Err(syn::Error::new(
            lit.span(),
            format!("{what} must be at least 1 (1 runs one call at a time)"),
        ));
    }
    Ok(n)
}

impl ActorOptions {
    fn parse(&mut self, meta: syn::meta::ParseNestedMeta) -> syn::Result<()> {
        if meta.path.is_ident("max_concurrency") {
            let lit: syn::LitInt = meta.value()?.parse()?;
            self.max_concurrency = Some(parse_limit(&lit, "max_concurrency")?);
            Ok(())
        } else if meta.path.is_ident("concurrency_groups") {
            meta.parse_nested_meta(|g| {
                let name = g.path.get_ident().cloned().ok_or_else(|| {
                    g.error("a concurrency group is named by a plain identifier: `io = 2`")
                })?;
                if self.groups.iter().any(|(n, _)| *n == name) {
                    return Err(g.error(format!("concurrency group `{name}` is declared twice")));
                }
                let lit: syn::LitInt = g.value()?.parse()?;
                let n = parse_limit(&lit, "a concurrency group's limit")?;
                self.groups.push((name, n));
                Ok(())
            })
        } else {
            Err(meta.error(
                "unknown option of #[rdt::actor]; the options are max_concurrency = N and \
                 concurrency_groups(name = N, ..)",
            ))
        }
    }
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
    if f.sig.asyncness.is_none() {
        return syn::Error::new(
            f.sig.fn_token.span(),
            "#[rdt::main] needs an `async fn main`",
        )
        .to_compile_error()
        .into();
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
    .into()
}

fn actor_struct(s: ItemStruct) -> syn::Result<TokenStream2> {
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

struct Method {
    ident: syn::Ident,
    index: u32,
    asyncness: bool,
    /// Takes `&mut self`.
    exclusive: bool,
    /// Concurrency group index (0: default).
    group: u32,
    args: Vec<(String, Type)>,
    value_ty: Type,
    is_result: bool,
    transport: TokenStream2,
    docs: Vec<syn::Attribute>,
}

/// If `ty` is `Result<T, ..>` (by last path segment), returns `T`.
fn result_ok_type(ty: &Type) -> Option<Type> {
    let Type::Path(p) = ty else { return None };
    let seg = p.path.segments.last()?;
    if seg.ident != "Result" {
        return None;
    }
    let syn::PathArguments::AngleBracketed(a) = &seg.arguments else {
        return None;
    };
    match a.args.first()? {
        syn::GenericArgument::Type(t) => Some(t.clone()),
        _ => None,
    }
}

fn is_method_attr(a: &syn::Attribute) -> bool {
    a.path()
        .segments
        .last()
        .map(|s| s.ident == "method")
        .unwrap_or(false)
}

/// The options of one `#[rdt::method(...)]`.
struct MethodOptions {
    /// The `rdt::Transport` expression of `tensor_transport`: a string
    /// names a built-in transport, checked while compiling by a const
    /// evaluation against the framework's own table (the macro keeps no
    /// list); a path is a program's own transport constant, checked by the
    /// type system.
    transport: TokenStream2,
    /// `concurrency_group = "name"`.
    group: Option<LitStr>,
}

fn parse_method_options(attrs: &[syn::Attribute]) -> syn::Result<MethodOptions> {
    let mut transport = quote!(::rdt::Transport::ObjectStore);
    let mut group = None;
    for a in attrs.iter().filter(|a| is_method_attr(a)) {
        if matches!(a.meta, syn::Meta::Path(_)) {
            continue;
        }
        a.parse_nested_meta(|meta| {
            if meta.path.is_ident("tensor_transport") {
                let value = meta.value()?;
                if value.peek(LitStr) {
                    let lit: LitStr = value.parse()?;
                    transport = quote_spanned! {lit.span()=>
                        {
                            const __RDT_TRANSPORT: ::rdt::Transport = ::rdt::Transport::built_in(#lit);
                            __RDT_TRANSPORT
                        }
                    };
                } else {
                    let path: syn::Path = value.parse()?;
                    transport = quote_spanned!(path.span()=> #path);
                }
                Ok(())
            } else if meta.path.is_ident("concurrency_group") {
                group = Some(meta.value()?.parse::<LitStr>()?);
                Ok(())
            } else {
                Err(meta.error("unknown option of #[rdt::method]; the options are tensor_transport = \"...\" (or = MY_TRANSPORT) and concurrency_group = \"name\""))
            }
        })?;
    }
    Ok(MethodOptions { transport, group })
}

/// Methods the generated handle has (see `actor_struct`): a remote method
/// of the same name would be a duplicate definition (E0592) with no hint.
const HANDLE_METHODS: &[&str] = &["id", "name", "kill", "pid", "raw"];
const HANDLE_METHODS_DOC: &str = "`id`, `name`, `kill`, `pid` and `raw` are taken";

fn actor_impl(mut imp: ItemImpl, opts: ActorOptions) -> syn::Result<TokenStream2> {
    if imp.trait_.is_some() {
        return Err(syn::Error::new(
            imp.span(),
            "#[rdt::actor] goes on the inherent impl block (`impl MyActor { .. }`), not on a trait impl",
        ));
    }
    if !imp.generics.params.is_empty() {
        return Err(syn::Error::new(
            imp.generics.span(),
            "rdt actors cannot be generic",
        ));
    }
    let ty_ident = match &*imp.self_ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last().map(|s| s.ident.clone()),
        _ => None,
    }
    .ok_or_else(|| syn::Error::new(imp.self_ty.span(), "#[rdt::actor] needs `impl TypeName`"))?;
    let self_ty = imp.self_ty.clone();
    let handle = format_ident!("{}Handle", ty_ident);

    let mut ctor: Option<(bool, Option<Type>, bool)> = None; // (async, arg type, returns Result)
    let mut methods = Vec::new();
    for item in &mut imp.items {
        let ImplItem::Fn(f) = item else { continue };
        let MethodOptions { transport, group } = parse_method_options(&f.attrs)?;
        f.attrs.retain(|a| !is_method_attr(a));
        let has_self = matches!(f.sig.inputs.first(), Some(FnArg::Receiver(_)));
        if !has_self {
            if f.sig.ident == "new" {
                let mut inputs = f.sig.inputs.iter();
                let arg = match (inputs.next(), inputs.next()) {
                    (None, _) => None,
                    (Some(FnArg::Typed(t)), None) => Some((*t.ty).clone()),
                    _ => return Err(syn::Error::new(
                        f.sig.inputs.span(),
                        "an actor's `new` takes at most one argument (use a struct for several)",
                    )),
                };
                let is_result = match &f.sig.output {
                    ReturnType::Type(_, t) => result_ok_type(t).is_some(),
                    ReturnType::Default => {
                        return Err(syn::Error::new(
                            f.sig.span(),
                            "an actor's `new` must return `Self`",
                        ))
                    }
                };
                ctor = Some((f.sig.asyncness.is_some(), arg, is_result));
            }
            continue;
        }
        if HANDLE_METHODS.iter().any(|m| f.sig.ident == m) {
            let m = &f.sig.ident;
            return Err(syn::Error::new(
                m.span(),
                format!(
                    "a remote method cannot be named `{m}`: every rdt actor handle has its own \
                     `{handle}::{m}` ({}), and the two would clash; rename this method",
                    HANDLE_METHODS_DOC
                ),
            ));
        }
        let mut exclusive = true;
        if let Some(FnArg::Receiver(r)) = f.sig.inputs.first() {
            if r.reference.is_none() {
                return Err(syn::Error::new(
                    r.span(),
                    "remote methods take `&mut self` or `&self`",
                ));
            }
            exclusive = r.mutability.is_some();
        }
        let group_index = match &group {
            None => 0u32,
            Some(_) if exclusive => {
                return Err(syn::Error::new(
                    group.span(),
                    "a `&mut self` method always runs alone, so it belongs to no concurrency \
                     group; take `&self` to run it in one",
                ))
            }
            Some(g) => match opts.groups.iter().position(|(n, _)| *n == g.value()) {
                Some(i) => i as u32 + 1,
                None => {
                    let declared: Vec<String> =
                        opts.groups.iter().map(|(n, _)| n.to_string()).collect();
                    return Err(syn::Error::new(
                        g.span(),
                        format!(
                            "concurrency group {:?} is not declared; declare it on the impl \
                             block: #[rdt::actor(concurrency_groups({} = N))] (declared: {})",
                            g.value(),
                            g.value(),
                            if declared.is_empty() {
                                "none".to_string()
                            } else {
                                declared.join(", ")
                            }
                        ),
                    ));
                }
            },
        };
        if !f.sig.generics.params.is_empty() {
            return Err(syn::Error::new(
                f.sig.generics.span(),
                "remote methods cannot be generic",
            ));
        }
        let mut args = Vec::new();
        for (i, input) in f.sig.inputs.iter().skip(1).enumerate() {
            let FnArg::Typed(t) = input else {
                unreachable!("only the first input is a receiver")
            };
            if let Type::Reference(_) | Type::ImplTrait(_) = &*t.ty {
                return Err(syn::Error::new(
                    t.ty.span(),
                    "arguments of remote methods must be owned, concrete types (they are deserialized in the worker)",
                ));
            }
            let name = match &*t.pat {
                Pat::Ident(p) => p.ident.to_string(),
                _ => format!("#{i}"),
            };
            args.push((name, (*t.ty).clone()));
        }
        let (value_ty, is_result) = match &f.sig.output {
            ReturnType::Default => (syn::parse_quote!(()), false),
            ReturnType::Type(_, t) => match result_ok_type(t) {
                Some(ok) => (ok, true),
                None => ((**t).clone(), false),
            },
        };
        methods.push(Method {
            ident: f.sig.ident.clone(),
            index: methods.len() as u32,
            asyncness: f.sig.asyncness.is_some(),
            exclusive,
            group: group_index,
            args,
            value_ty,
            is_result,
            transport,
            docs: f
                .attrs
                .iter()
                .filter(|a| a.path().is_ident("doc"))
                .cloned()
                .collect(),
        });
    }
    let Some((ctor_async, ctor_arg, ctor_result)) = ctor else {
        return Err(syn::Error::new(
            imp.self_ty.span(),
            "an #[rdt::actor] impl needs a constructor: `fn new(args: A) -> Self` (async or not, at most one argument, may return Result<Self, E>)",
        ));
    };

    let args_ty: Type = ctor_arg.clone().unwrap_or_else(|| syn::parse_quote!(()));
    let call_new = if ctor_arg.is_some() {
        quote!(<#self_ty>::new(args))
    } else {
        quote!({
            let () = args;
            <#self_ty>::new()
        })
    };
    let await_new = if ctor_async { quote!(.await) } else { quote!() };
    let construct_body = if ctor_result {
        quote!(#call_new #await_new .map_err(|e| ::std::string::ToString::to_string(&e)))
    } else {
        quote!(::core::result::Result::Ok(#call_new #await_new))
    };

    let mut arms = Vec::new();
    let mut shared_arms = Vec::new();
    let mut infos = Vec::new();
    let mut handle_fns = Vec::new();
    // Item-level constants: evaluated while compiling even if no handle
    // method is ever called (the handle methods are generic).
    let transport_checks = methods.iter().map(|m| {
        let t = &m.transport;
        quote!(const _: ::rdt::Transport = #t;)
    });
    for m in &methods {
        let Method {
            ident,
            index,
            asyncness,
            exclusive,
            group,
            args,
            value_ty,
            is_result,
            transport,
            docs,
        } = m;
        let n = args.len();
        let locals: Vec<_> = (0..n).map(|i| format_ident!("__a{}", i)).collect();
        let decodes = args.iter().enumerate().map(|(i, (name, ty))| {
            let l = &locals[i];
            quote_spanned!(ty.span()=> let #l: #ty = __args.decode(#i, #name)?;)
        });
        let aw = if *asyncness { quote!(.await) } else { quote!() };
        let unwrap = if *is_result {
            quote!(let __ret = match __ret {
                ::core::result::Result::Ok(v) => v,
                ::core::result::Result::Err(e) => {
                    #[allow(unused_imports)]
                    use ::rdt::__private::{TypedViaNothing as _, TypedViaSerialize as _};
                    let __typed = (&::rdt::__private::AppError(&e)).typed();
                    return ::core::result::Result::Err(__args.app_error(&e, __typed));
                }
            };)
        } else {
            quote!()
        };
        let arm = quote! {
            #index => {
                __args.expect_len(#n)?;
                #(#decodes)*
                let __ret = self.#ident(#(#locals),*) #aw;
                #unwrap
                ::rdt::__private::encode_return(&__ret, &__args)
            }
        };
        if !exclusive {
            shared_arms.push(arm.clone());
        }
        arms.push(arm);
        let name_str = ident.to_string();
        infos.push(
            quote!(#index => ::core::option::Option::Some(::rdt::__private::MethodInfo {
            name: #name_str,
            exclusive: #exclusive,
            group: #group,
        }),),
        );
        let params = args.iter().enumerate().map(|(i, (_, ty))| {
            let l = &locals[i];
            quote!(#l: impl ::core::convert::Into<::rdt::Arg<#ty>>)
        });
        handle_fns.push(quote! {
            #(#docs)*
            #[allow(private_interfaces, clippy::too_many_arguments)]
            pub fn #ident(&self, #(#params),*) -> ::rdt::Call<#value_ty> {
                #[allow(unused_mut)]
                let mut __c = ::rdt::__private::Call::new(&self.raw, #index, #name_str, #transport);
                #(__c.push_arg(::core::convert::Into::into(#locals));)*
                __c
            }
        });
    }
    let reg = format_ident!("__RDT_REGISTRATION_{}", ty_ident);
    let max_concurrency = opts.max_concurrency.unwrap_or(1);
    let group_names: Vec<String> = opts.groups.iter().map(|(n, _)| n.to_string()).collect();
    let group_limits: Vec<u32> = opts.groups.iter().map(|(_, l)| *l).collect();

    Ok(quote! {
        #imp

        impl ::rdt::Actor for #self_ty {
            type Args = #args_ty;
            type Handle = #handle;
            const NAME: &'static str = ::core::concat!(::core::module_path!(), "::", ::core::stringify!(#ty_ident));
            const __CONCURRENCY: ::rdt::__private::Concurrency = ::rdt::__private::Concurrency {
                max: #max_concurrency,
                groups: &[#((#group_names, #group_limits)),*],
            };

            fn __construct(args: Self::Args) -> ::rdt::__private::LocalBoxFuture<'static, ::core::result::Result<Self, ::std::string::String>> {
                ::std::boxed::Box::pin(async move { #construct_body })
            }

            #[allow(unused_variables, unreachable_code)]
            fn __dispatch(&mut self, method: u32, __args: ::rdt::__private::CallArgs) -> ::rdt::__private::LocalBoxFuture<'_, ::rdt::Result<::rdt::__private::Payload>> {
                ::std::boxed::Box::pin(async move {
                    match method {
                        #(#arms)*
                        other => ::core::result::Result::Err(::rdt::Error::Protocol(::std::format!("{} has no method #{}", <Self as ::rdt::Actor>::NAME, other))),
                    }
                })
            }

            #[allow(unused_variables, unreachable_code)]
            fn __dispatch_shared(&self, method: u32, __args: ::rdt::__private::CallArgs) -> ::rdt::__private::LocalBoxFuture<'_, ::rdt::Result<::rdt::__private::Payload>> {
                ::std::boxed::Box::pin(async move {
                    match method {
                        #(#shared_arms)*
                        other => ::core::result::Result::Err(::rdt::Error::Protocol(::std::format!("{} has no `&self` method #{}", <Self as ::rdt::Actor>::NAME, other))),
                    }
                })
            }

            fn __method_info(method: u32) -> ::core::option::Option<::rdt::__private::MethodInfo> {
                match method {
                    #(#infos)*
                    _ => ::core::option::Option::None,
                }
            }
        }

        impl #handle {
            #(#handle_fns)*
        }

        #(#transport_checks)*

        #[::rdt::__private::linkme::distributed_slice(::rdt::__private::ACTOR_TYPES)]
        #[linkme(crate = ::rdt::__private::linkme)]
        #[allow(non_upper_case_globals)]
        static #reg: ::rdt::__private::ActorRegistration = ::rdt::__private::ActorRegistration {
            name: <#self_ty as ::rdt::Actor>::NAME,
            run: ::rdt::__private::run_worker::<#self_ty>,
        };
    })
}
