//! Reading what the user wrote: the `#[rdt::actor(...)]` options, the
//! impl block's constructor and methods, and each method's
//! `#[rdt::method(...)]` options. Nothing here emits code.

use proc_macro2::{Ident, TokenStream as TokenStream2};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, ImplItem, ItemImpl, LitStr, Pat, ReturnType, Type};

/// `#[rdt::actor(max_concurrency = N, concurrency_groups(name = N, ..))]`
/// on the impl block.
#[derive(Default)]
pub(crate) struct ActorOptions {
    pub(crate) max_concurrency: Option<u32>,
    pub(crate) groups: Vec<(syn::Ident, u32)>,
}

pub(crate) fn parse_limit(lit: &syn::LitInt, what: &str) -> syn::Result<u32> {
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
    pub(crate) fn parse(&mut self, meta: syn::meta::ParseNestedMeta) -> syn::Result<()> {
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

pub(crate) struct Method {
    pub(crate) ident: syn::Ident,
    pub(crate) index: u32,
    pub(crate) asyncness: bool,
    /// Takes `&mut self`.
    pub(crate) exclusive: bool,
    /// Concurrency group index (0: default).
    pub(crate) group: u32,
    pub(crate) args: Vec<(String, Type)>,
    pub(crate) value_ty: Type,
    pub(crate) is_result: bool,
    pub(crate) transport: TokenStream2,
    pub(crate) docs: Vec<syn::Attribute>,
}

/// If `ty` is `Result<T, ..>` (by last path segment), returns `T`.
pub(crate) fn result_ok_type(ty: &Type) -> Option<Type> {
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

pub(crate) fn is_method_attr(a: &syn::Attribute) -> bool {
    a.path()
        .segments
        .last()
        .map(|s| s.ident == "method")
        .unwrap_or(false)
}

/// The options of one `#[rdt::method(...)]`.
pub(crate) struct MethodOptions {
    /// The `rdt::Transport` expression of `tensor_transport`: a string
    /// names a built-in transport, checked while compiling by a const
    /// evaluation against the framework's own table (the macro keeps no
    /// list); a path is a program's own transport constant, checked by the
    /// type system.
    pub(crate) transport: TokenStream2,
    /// `concurrency_group = "name"`.
    pub(crate) group: Option<LitStr>,
}

pub(crate) fn parse_method_options(attrs: &[syn::Attribute]) -> syn::Result<MethodOptions> {
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
pub(crate) const HANDLE_METHODS: &[&str] = &["id", "name", "kill", "pid", "raw"];

pub(crate) const HANDLE_METHODS_DOC: &str = "`id`, `name`, `kill`, `pid` and `raw` are taken";

/// An actor's impl block as read ([`actor_impl`]).
pub(crate) struct ActorImpl {
    /// The block, its method attributes taken off.
    pub(crate) imp: ItemImpl,
    pub(crate) ty_ident: Ident,
    pub(crate) self_ty: Box<Type>,
    /// `<Name>Handle`.
    pub(crate) handle: Ident,
    /// The constructor: async, its argument's type, whether it returns a
    /// `Result`.
    pub(crate) ctor_async: bool,
    pub(crate) ctor_arg: Option<Type>,
    pub(crate) ctor_result: bool,
    pub(crate) methods: Vec<Method>,
}

/// Reads an actor's impl block: its type, its constructor and its remote
/// methods (each checked against `opts`' concurrency groups). The block's
/// method attributes are taken off as they are read.
pub(crate) fn actor_impl(mut imp: ItemImpl, opts: &ActorOptions) -> syn::Result<ActorImpl> {
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
    Ok(ActorImpl {
        imp,
        ty_ident,
        self_ty,
        handle,
        ctor_async,
        ctor_arg,
        ctor_result,
        methods,
    })
}
