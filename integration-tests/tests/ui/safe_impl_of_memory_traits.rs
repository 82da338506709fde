// ExternalMemory and DeviceBuffer hand raw pointers to safe accessors: a
// wrong implementation is undefined behaviour in safe code, so they are
// `unsafe trait`s and a safe `impl` is refused.
struct Mine(Vec<u8>);

impl rdt::data::ExternalMemory for Mine {
    fn as_ptr(&self) -> *mut u8 {
        self.0.as_ptr() as *mut u8
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn describe(&self) -> String {
        "mine".into()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

struct MyDevice(std::sync::Arc<rdt::data::cuda::Gpu>);

impl rdt::data::cuda::DeviceBuffer for MyDevice {
    fn device_ptr(&self) -> u64 {
        0
    }
    fn len(&self) -> usize {
        0
    }
    fn gpu(&self) -> &std::sync::Arc<rdt::data::cuda::Gpu> {
        &self.0
    }
    fn describe(&self) -> String {
        "mine".into()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn main() {}
