//! Opening a shared library at run time from a list of candidates (NCCL,
//! NIXL: libraries rdt builds without).

/// Opens the first of `candidates` that loads: a path (a name with a
/// `/`) that does not exist is skipped, a bare name goes to the loader.
/// Returns the library and the name it was found under, or each
/// candidate's failure (`"name: why"`), in order.
///
/// # Safety
/// Loading a library runs its initializers: the candidates must name
/// libraries whose initializers are sound to run in this process.
pub(crate) unsafe fn open_first(
    candidates: &[String],
) -> Result<(libloading::Library, String), Vec<String>> {
    let mut errors = Vec::new();
    for name in candidates {
        if name.contains('/') && !std::path::Path::new(name).exists() {
            errors.push(format!("{name}: no such file"));
            continue;
        }
        // SAFETY: the caller vouches for the library's initializers.
        match unsafe { libloading::Library::new(name) } {
            Ok(l) => return Ok((l, name.clone())),
            Err(e) => errors.push(format!("{name}: {e}")),
        }
    }
    Err(errors)
}
