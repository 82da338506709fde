//! The expansion of an actor's impl block: dispatch, the handle's
//! methods, and the registration the worker starts the actor from.

use proc_macro2::TokenStream as TokenStream2;
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::Type;

use crate::parse::{ActorImpl, ActorOptions, Method};

/// An actor's impl block, read ([`ActorImpl`]), with what it needs: the
/// block itself, the dispatch of calls to its methods (one at a time, or
/// interleaved up to the limits of `opts`), the handle's typed methods,
/// and the actor's registration.
pub(crate) fn actor_impl(parsed: ActorImpl, opts: &ActorOptions) -> syn::Result<TokenStream2> {
    let ActorImpl {
        imp,
        ty_ident,
        self_ty,
        handle,
        ctor_async,
        ctor_arg,
        ctor_result,
        methods,
    } = parsed;
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
