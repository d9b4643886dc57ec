// A stand-in DirectML device for Linux and CI (dml_optim.standin; see its docstring).
//
// Registers the PrivateUse1 backend ("privateuseone") the way torch-directml 0.2.5 does: every tensor is
// an ATen OpaqueTensorImpl without storage whose handle is a CPU tensor (the "device memory"); views are
// new impls over views of the handle; a few kernels of its own, everything else through ONE boxed
// fallback that runs the op on the handles on the CPU and wraps the results, counting, warning about or
// refusing (strict) the ops the recorded dispatch table (given by _init) marks as falling back.
// Also: float64 refusal (GPUs without FP64), bfloat16 refusal, a device generator, a device guard
// (one device, index 0), the PrivateUse1 hooks and, on newer torch, a DeviceAllocator.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/OpaqueTensorImpl.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <torch/version.h>
#if __has_include(<c10/core/CachingDeviceAllocator.h>)
#include <c10/core/CachingDeviceAllocator.h>
#endif

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>

namespace {

using c10::DeviceType;
constexpr DeviceType kDev = DeviceType::PrivateUse1;
const c10::Device kDevice(kDev, 0);

// ---- settings, the dispatch table, counts -------------------------------------------------------

std::atomic<bool> g_strict{false}, g_float64{true}, g_generator{true};

struct Entry {
  bool fallback;        // the real plugin runs the op through its CPU fallback
  std::string warn_as;  // the op its fallback sees ("fallback via aten::X": aten::X)
  bool cpu_f64_ok;      // a CPU float64 0-dim argument works (fallback ops, structured .out kernels)
};
std::unordered_map<std::string, Entry> g_table;
std::mutex g_mutex;  // guards the counts and the warned set
std::map<std::string, int64_t> g_fallback_counts, g_unknown_counts;
std::set<std::string> g_warned;

const char* kNoDouble = "The GPU device does not support Double (Float64) operations!";

void check_dtype(c10::ScalarType t) {
  TORCH_CHECK(t != at::kBFloat16,
              "Invalid or unsupported data type BFloat16 (dml_optim.standin: torch-directml has no bfloat16; "
              "the real plugin ends the process here with a fatal error in dml_util.cc)");
  TORCH_CHECK(t != at::kDouble || g_float64.load(), kNoDouble);
}

// ---- the tensor ---------------------------------------------------------------------------------

// The handle: a CPU tensor.  (A struct, not at::Tensor itself: OpaqueTensorImpl<at::Tensor> does not
// compile, its release_resources() assigns `{}`, which is ambiguous for at::Tensor.)
struct Handle {
  at::Tensor t;
};
using Base = at::OpaqueTensorImpl<Handle>;

struct Impl : public Base {
  Impl(c10::DispatchKeySet ks, const caffe2::TypeMeta dt, const at::Tensor& h)
      : Base(ks, dt, kDevice, Handle{h}, h.sizes(), false) {
    sync();
  }
  // sizes, strides and storage offset from the handle (the handle is the truth)
  void sync() {
    const at::Tensor& h = opaque_handle().t;
    set_custom_sizes_strides(SizesStridesPolicy::Default);  // strides/is_contiguous answer
    sizes_and_strides_.set_sizes(h.sizes());
    for (int64_t i = 0; i < h.dim(); ++i) sizes_and_strides_.stride_at_unchecked(i) = h.stride(i);
    storage_offset_ = h.storage_offset();
    refresh_numel();
    refresh_contiguous();
  }
  void rebind(const at::Tensor& h) {
    unsafe_opaque_handle().t = h;
    sync();
  }
  // like DmlTensorImpl: metadata setters work (OpaqueTensorImpl's throw)
  void set_size(int64_t dim, int64_t v) override {
    sizes_and_strides_.size_at(dim) = v;
    refresh_numel();
    refresh_contiguous();
  }
  void set_stride(int64_t dim, int64_t v) override {
    sizes_and_strides_.stride_at_unchecked(dim) = v;
    refresh_contiguous();
  }
  void set_storage_offset(int64_t off) override { storage_offset_ = off; }

  template <typename VC>
  c10::intrusive_ptr<c10::TensorImpl> detach_impl(VC&& vc, bool allow_meta) const {
    auto impl = c10::make_intrusive<Impl>(key_set(), dtype(), opaque_handle().t);
    copy_tensor_metadata(this, impl.get(), std::forward<VC>(vc), allow_meta);
    impl->refresh_numel();
    return impl;
  }
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(const c10::VariableVersion& vc,
                                                              bool allow_meta) const override {
    return detach_impl(vc, allow_meta);
  }
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(c10::VariableVersion&& vc,
                                                              bool allow_meta) const override {
    return detach_impl(std::move(vc), allow_meta);
  }
};

bool is_dev(const at::Tensor& t) { return t.defined() && t.device().type() == kDev; }

Impl* impl_of(const at::Tensor& t) {
  auto* impl = dynamic_cast<Impl*>(t.unsafeGetTensorImpl());
  TORCH_CHECK(impl != nullptr, "dml_optim.standin: a privateuseone tensor that the stand-in did not make");
  return impl;
}

at::Tensor wrap(const at::Tensor& h) {
  check_dtype(h.scalar_type());
  return at::detail::make_tensor<Impl>(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), h.dtype(), h);
}

// The CPU tensor behind a device tensor, with the device tensor's sizes, strides and offset.
at::Tensor unwrap(const at::Tensor& t) {
  const at::Tensor& h = impl_of(t)->opaque_handle().t;
  if (h.sizes() == t.sizes() && h.strides() == t.strides() && h.storage_offset() == t.storage_offset()) return h;
  return h.as_strided(t.sizes(), t.strides(), t.storage_offset());
}

// ---- the generator ------------------------------------------------------------------------------

// A device generator whose state is a CPU generator's: the fallback hands that one to CPU kernels.
struct Gen : public c10::GeneratorImpl {
  at::Generator cpu;
  explicit Gen(uint64_t seed = c10::default_rng_seed_val)
      : c10::GeneratorImpl(kDevice, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu(at::detail::createCPUGenerator(seed)) {}
  static DeviceType device_type() { return kDev; }
  void set_current_seed(uint64_t s) override { cpu.set_current_seed(s); }
  void set_offset(uint64_t o) override { cpu.set_offset(o); }
  uint64_t get_offset() const override { return cpu.get_offset(); }
  uint64_t current_seed() const override { return cpu.current_seed(); }
  uint64_t seed() override { return cpu.seed(); }
  void set_state(const c10::TensorImpl& s) override { cpu.unsafeGetGeneratorImpl()->set_state(s); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return cpu.unsafeGetGeneratorImpl()->get_state();
  }
  Gen* clone_impl() const override {
    auto* g = new Gen();
    g->cpu = cpu.clone();
    return g;
  }
};

at::Generator& default_gen() {
  static at::Generator g = at::make_generator<Gen>(c10::default_rng_seed_val);
  return g;
}
at::Generator cpu_of(const at::Generator& g) {
  auto* impl = dynamic_cast<Gen*>(g.unsafeGetGeneratorImpl());
  TORCH_CHECK(impl != nullptr, "dml_optim.standin: a privateuseone generator that the stand-in did not make");
  return impl->cpu;
}

at::Generator new_gen(c10::DeviceIndex) {
  TORCH_CHECK(g_generator.load(), "Device type PRIVATEUSEONE is not supported for torch.Generator() api.");
  return at::make_generator<Gen>(c10::default_rng_seed_val);
}
// torch.Generator("privateuseone"): the hooks' getNewGenerator where the hooks have one (newer torch,
// which deprecates the older registration), else REGISTER_GENERATOR_PRIVATEUSE1 (torch 2.4).
template <typename T, typename = void>
struct has_new_generator : std::false_type {};
template <typename T>
struct has_new_generator<T, std::void_t<decltype(&T::getNewGenerator)>> : std::true_type {};
const bool g_generator_registered =
    has_new_generator<at::PrivateUse1HooksInterface>::value || (at::_GeneratorRegister(new_gen), true);

// Runs a random op that has no Generator argument (native_dropout) on the device's default stream:
// the CPU default generator holds the device generator's state meanwhile.
struct DefaultGenSwap {
  at::Generator cpu_default = at::detail::getDefaultCPUGenerator();
  at::Generator dev = cpu_of(default_gen());
  at::Tensor saved;
  DefaultGenSwap() {
    std::scoped_lock lock(cpu_default.mutex(), dev.mutex());
    saved = cpu_default.get_state();
    cpu_default.set_state(dev.get_state());
  }
  ~DefaultGenSwap() {
    std::scoped_lock lock(cpu_default.mutex(), dev.mutex());
    dev.set_state(cpu_default.get_state());
    cpu_default.set_state(saved);
  }
};

// ---- device guard and hooks ---------------------------------------------------------------------

struct Guard final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return kDev; }
  c10::Device exchangeDevice(c10::Device d) const override { return kDevice; }
  c10::Device getDevice() const override { return kDevice; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kDev && d.index() <= 0, "dml_optim.standin has one device, privateuseone:0; got ", d);
  }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, kDevice); }
  c10::Stream getDefaultStream(c10::Device) const override { return c10::Stream(c10::Stream::DEFAULT, kDevice); }
  c10::Stream exchangeStream(c10::Stream) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, kDevice);
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// The hooks' methods differ between torch versions (torch 2.4: getDefaultGenerator is not const and
// there is no isBuilt/isAvailable/getNewGenerator); methods a version lacks are plain members here.
struct Hooks : public at::PrivateUse1HooksInterface {
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) { return default_gen(); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const { return default_gen(); }
  at::Generator getNewGenerator(c10::DeviceIndex i) const { return new_gen(i); }
  at::Device getDeviceFromPtr(void*) const override { return kDevice; }
  bool isBuilt() const { return true; }
  bool isAvailable() const { return true; }
  bool isPinnedPtr(const void*) const { return false; }
  void init() const {}
  c10::DeviceIndex deviceCount() const { return 1; }
  void setCurrentDevice(c10::DeviceIndex) const {}
  c10::DeviceIndex getCurrentDevice() const { return 0; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const { return 0; }
};

#if __has_include(<c10/core/CachingDeviceAllocator.h>) && (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 9)
#define STANDIN_DEVICE_ALLOCATOR 1
// Newer torch's torch.accelerator memory API (accelerate's free_memory calls empty_cache) wants the
// accelerator's allocator to be a DeviceAllocator.  The stand-in's tensors never use it: it reports
// "not initialized" (empty_cache is then a no-op), no stats, and the host's memory as the device's.
void release(void* p) { std::free(p); }
struct Allocator final : public c10::DeviceAllocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n == 0 ? nullptr : std::malloc(n);
    return {p, p, &release, kDevice};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dst, const void* src, std::size_t n) const override { std::memcpy(dst, src, n); }
  bool initialized() override { return false; }
  void emptyCache(c10::MempoolId_t) override {}
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex) override { return {}; }
  void resetAccumulatedStats(c10::DeviceIndex) override {}
  void resetPeakStats(c10::DeviceIndex) override {}
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex) override {
    const size_t page = sysconf(_SC_PAGESIZE);
    return {page * sysconf(_SC_AVPHYS_PAGES), page * sysconf(_SC_PHYS_PAGES)};
  }
};
#endif

// ---- kernels of its own -------------------------------------------------------------------------

at::TensorOptions cpu_options(std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                              std::optional<at::Device> device) {
  TORCH_CHECK(!device.has_value() || device->index() <= 0, "dml_optim.standin has one device, privateuseone:0; got ",
              *device);
  auto st = dtype.value_or(c10::typeMetaToScalarType(at::get_default_dtype()));
  check_dtype(st);
  return at::TensorOptions().dtype(st).layout(layout.value_or(at::kStrided)).device(at::kCPU);
}

at::Tensor empty_memory_format(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool>, std::optional<at::MemoryFormat> mf) {
  return wrap(at::empty(size, cpu_options(dtype, layout, device), mf));
}

at::Tensor empty_strided(at::IntArrayRef size, at::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device, std::optional<bool>) {
  return wrap(at::empty_strided(size, stride, cpu_options(dtype, layout, device)));
}

// views: a new impl over the view of the handle (same CPU memory)
at::Tensor as_strided(const at::Tensor& self, at::IntArrayRef size, at::IntArrayRef stride,
                      std::optional<int64_t> offset) {
  return wrap(unwrap(self).as_strided(size, stride, offset));
}
// in place (t_, transpose_, squeeze_, unsqueeze_ go through it): the tensor takes the view's handle
const at::Tensor& as_strided_(const at::Tensor& self, at::IntArrayRef size, at::IntArrayRef stride,
                              std::optional<int64_t> offset) {
  impl_of(self)->rebind(unwrap(self).as_strided(size, stride, offset));
  return self;
}
at::Tensor view(const at::Tensor& self, at::IntArrayRef size) { return wrap(unwrap(self).view(size)); }
at::Tensor alias(const at::Tensor& self) { return wrap(unwrap(self).alias()); }
at::Tensor reshape_alias(const at::Tensor& self, at::IntArrayRef size, at::IntArrayRef stride) {
  return wrap(at::_reshape_alias(unwrap(self), size, stride));
}
at::Tensor unsafe_view(const at::Tensor& self, at::IntArrayRef size) {
  return wrap(at::_unsafe_view(unwrap(self), size));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  if (is_dev(self)) check_dtype(self.scalar_type());
  if (is_dev(dst)) check_dtype(dst.scalar_type());
  at::Tensor src = is_dev(self) ? unwrap(self) : self;
  if (is_dev(dst)) {
    unwrap(dst).copy_(src, non_blocking);
  } else {
    const_cast<at::Tensor&>(dst).copy_(src, non_blocking);
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (is_dev(dst)) {
    at::Tensor h = unwrap(dst);
    h.resize_(self.sizes());
    impl_of(dst)->rebind(h);
  } else {
    const_cast<at::Tensor&>(dst).resize_(self.sizes());
  }
  return copy_from(self, dst, false);
}

// torch-directml's own rsub.Scalar (the table: native) turns the Scalar into a CPU wrapped-number tensor
// and runs rsub.Tensor, which moves it to the GPU: `1.0 - x` needs float64 there (torch's
// CompositeExplicitAutograd rsub.Scalar would go through sub.Tensor, which reads the scalar as a number).
at::Tensor rsub_scalar(const at::Tensor& self, const at::Scalar& other, const at::Scalar& alpha) {
  at::Tensor wrapped = at::scalar_to_tensor(other);
  wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
  return at::rsub(self, wrapped, alpha);
}

// PrivateUse1's convolution hooks (the table: native): the CPU's convolution on the handles.
std::optional<at::Tensor> unwrap_opt(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  return is_dev(*t) ? unwrap(*t) : *t;
}
at::Tensor wrap_opt(const at::Tensor& t) { return t.defined() ? wrap(t) : t; }

at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                       at::IntArrayRef output_padding, int64_t groups) {
  return wrap(at::convolution(unwrap(input), unwrap(weight), unwrap_opt(bias), stride, padding, dilation, transposed,
                              output_padding, groups));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed, at::IntArrayRef output_padding,
    int64_t groups, std::array<bool, 3> output_mask) {
  std::vector<int64_t> bias_sizes{transposed ? weight.size(1) * groups : weight.size(0)};
  auto [gi, gw, gb] = at::convolution_backward(unwrap(grad_output), unwrap(input), unwrap(weight), bias_sizes,
                                               stride, padding, dilation, transposed, output_padding, groups,
                                               output_mask);
  return {wrap_opt(gi), wrap_opt(gw), wrap_opt(gb)};
}

// ---- the boxed fallback -------------------------------------------------------------------------

std::string op_name(const c10::FunctionSchema& s) {
  return s.overload_name().empty() ? s.name() : s.name() + "." + s.overload_name();
}

bool is_optional_generator(const c10::TypePtr& t) {
  if (t->kind() != c10::TypeKind::OptionalType) return false;
  return t->expectRef<c10::OptionalType>().getElementType()->kind() == c10::TypeKind::GeneratorType;
}

// Counts, warns (once per op) and refuses (strict) an op per the table; returns its entry.
const Entry* account(const std::string& name) {
  auto it = g_table.find(name);
  const Entry* e = it == g_table.end() ? nullptr : &it->second;
  if (e != nullptr && !e->fallback) return e;
  const std::string& warn_as = e != nullptr ? e->warn_as : name;
  if (g_strict.load()) {
    if (e != nullptr)
      TORCH_CHECK(false, "dml_optim.standin (strict): the operator '", name, "' falls back to the CPU on ",
                  "torch-directml 0.2.5 (its CPU fallback runs '", warn_as, "')");
    TORCH_CHECK(false, "dml_optim.standin (strict): the operator '", name, "' is not in the recorded ",
                "torch-directml 0.2.5 dispatch table (counted as a fallback)");
  }
  bool warn;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    ++(e != nullptr ? g_fallback_counts : g_unknown_counts)[name];
    warn = g_warned.insert(warn_as).second;
  }
  if (warn && e != nullptr) {
    TORCH_WARN("The operator '", warn_as, "' is not currently supported on the DML backend and will fall back ",
               "to run on the CPU. This may have performance implications.");
  } else if (warn) {
    TORCH_WARN("dml_optim.standin: the operator '", name, "' is not in the recorded torch-directml 0.2.5 ",
               "dispatch table; the stand-in runs it on the CPU like a fallback (dml_optim.standin.unknown())");
  }
  return e;
}

void check_arg(const at::Tensor& t, bool cpu_f64_ok, bool same_device) {
  if (!t.defined()) return;
  if (is_dev(t)) {
    TORCH_CHECK(t.scalar_type() != at::kDouble || g_float64.load(), kNoDouble);
  } else if (t.dim() == 0) {
    TORCH_CHECK(t.scalar_type() != at::kDouble || g_float64.load() || cpu_f64_ok, kNoDouble);
  } else {
    TORCH_CHECK(!same_device, "Expected all tensors to be on the same device, but found at least two devices, ",
                kDevice, " and ", t.device(), "!");
  }
}

bool is_optional_tensor_list(const c10::IValue& v) {
  if (!v.isList()) return false;
  const auto t = v.toList().elementType();
  return t->kind() == c10::TypeKind::OptionalType &&
         t->expectRef<c10::OptionalType>().getElementType()->kind() == c10::TypeKind::TensorType;
}

c10::IValue unwrap_ivalue(const c10::IValue& v, bool cpu_f64_ok, bool same_device) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    check_arg(t, cpu_f64_ok, same_device);
    return is_dev(t) ? c10::IValue(unwrap(t)) : v;
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) {
      check_arg(t, cpu_f64_ok, same_device);
      out.push_back(is_dev(t) ? unwrap(t) : t);
    }
    return out;
  }
  if (is_optional_tensor_list(v)) {  // Tensor?[] (index, index_put_): CPU index tensors are allowed
    auto in = v.toList();
    c10::impl::GenericList out(in.elementType());
    for (const c10::IValue& e : in) out.push_back(unwrap_ivalue(e, cpu_f64_ok, false));
    return out;
  }
  if (v.isGenerator()) {
    const at::Generator& g = v.toGenerator();
    return g.device().type() == kDev ? c10::IValue(cpu_of(g)) : v;
  }
  if (v.isDevice() && v.toDevice().type() == kDev) return c10::IValue(c10::Device(at::kCPU));
  return v;
}

c10::IValue wrap_ivalue(const c10::IValue& v, const std::vector<c10::IValue>& args,
                        const std::vector<c10::IValue>& handles) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined() || is_dev(t)) return v;
    for (size_t i = 0; i < handles.size(); ++i)  // an argument returned as is
      if (handles[i].isTensor() && handles[i].toTensor().is_same(t) && args[i].isTensor()) return args[i];
    return wrap(t);
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(wrap_ivalue(t, args, handles).toTensor());
    return out;
  }
  if (is_optional_tensor_list(v)) {
    auto in = v.toList();
    c10::impl::GenericList out(in.elementType());
    for (const c10::IValue& e : in) out.push_back(wrap_ivalue(e, args, handles));
    return out;
  }
  return v;
}

// after an in-place or out= op: the device tensor takes the handle's (maybe resized) metadata
void resync(const c10::IValue& arg, const c10::IValue& handle) {
  if (arg.isTensor() && is_dev(arg.toTensor())) {
    const at::Tensor& t = arg.toTensor();
    const at::Tensor& h = handle.toTensor();
    if (h.sizes() != t.sizes() || h.strides() != t.strides() || h.storage_offset() != t.storage_offset() ||
        !h.is_same(impl_of(t)->opaque_handle().t))
      impl_of(t)->rebind(h);
  } else if (arg.isTensorList()) {
    auto a = arg.toTensorList();
    auto h = handle.toTensorList();
    for (size_t i = 0; i < a.size(); ++i) resync(c10::IValue(a.get(i)), c10::IValue(h.get(i)));
  }
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const std::string name = op_name(schema);
  const Entry* e = account(name);
  const bool cpu_f64_ok = e == nullptr || e->cpu_f64_ok;
  const bool same_device = e != nullptr && !e->fallback;  // the plugin's own kernels want one device
  const auto& sargs = schema.arguments();
  const size_t n = sargs.size(), base = stack->size() - n;
  std::vector<c10::IValue> args(stack->begin() + base, stack->end()), handles(n);
  bool has_generator = false;
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = (*stack)[base + i];
    if (is_optional_generator(sargs[i].type())) {
      has_generator = true;
      if (v.isNone()) v = c10::IValue(cpu_of(default_gen()));  // the device's default generator
    }
    v = unwrap_ivalue(v, cpu_f64_ok, same_device);
    handles[i] = v;
  }
  {
    std::optional<DefaultGenSwap> swap;
    if (!has_generator && name == "aten::native_dropout") swap.emplace();
    op.callBoxed(stack);
  }
  const auto& rets = schema.returns();
  const size_t rbase = stack->size() - rets.size();
  for (size_t i = 0; i < n; ++i)
    if (sargs[i].alias_info() != nullptr && sargs[i].alias_info()->isWrite()) resync(args[i], handles[i]);
  for (size_t j = 0; j < rets.size(); ++j) {
    c10::IValue& r = (*stack)[rbase + j];
    const auto* ra = rets[j].alias_info();
    bool done = false;
    if (ra != nullptr && ra->isWrite()) {  // in-place / out=: the argument itself
      for (size_t i = 0; i < n && !done; ++i) {
        const auto* aa = sargs[i].alias_info();
        if (aa != nullptr && aa->beforeSets() == ra->beforeSets()) {
          r = args[i];
          done = true;
        }
      }
    }
    if (!done) r = wrap_ivalue(r, args, handles);
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("as_strided_", as_strided_);
  m.impl("view", view);
  m.impl("alias", alias);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("_unsafe_view", unsafe_view);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("rsub.Scalar", rsub_scalar);
  m.impl("convolution_overrideable", convolution);
  m.impl("convolution_backward_overrideable", convolution_backward);
}

// ---- Python ------------------------------------------------------------------------------------

void init(const std::vector<std::tuple<std::string, bool, std::string, bool>>& table) {
  static bool hooks_registered = false;
  if (!hooks_registered) {
    at::RegisterPrivateUse1HooksInterface(new Hooks());
#ifdef STANDIN_DEVICE_ALLOCATOR
    static Allocator allocator;
    c10::SetAllocator(kDev, &allocator);
#endif
    hooks_registered = true;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  g_table.clear();
  for (const auto& [name, fb, warn_as, ok] : table) g_table[name] = Entry{fb, warn_as, ok};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("_init", &init);
  m.def("_configure", [](bool strict, bool float64, bool generator) {
    g_strict = strict;
    g_float64 = float64;
    g_generator = generator;
  });
  m.def("_counts", [] {
    std::lock_guard<std::mutex> lock(g_mutex);
    return std::make_pair(g_fallback_counts, g_unknown_counts);
  });
  m.def("_reset", [] {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_fallback_counts.clear();
    g_unknown_counts.clear();
    g_warned.clear();
  });
  m.def("_manual_seed", [](uint64_t seed) {
    std::lock_guard<std::mutex> lock(default_gen().mutex());
    default_gen().set_current_seed(seed);
  });
  m.def("_seed", [] {
    std::lock_guard<std::mutex> lock(default_gen().mutex());
    return default_gen().seed();
  });
  m.def("_initial_seed", [] { return default_gen().current_seed(); });
  m.def("_get_rng_state", [] {
    std::lock_guard<std::mutex> lock(default_gen().mutex());
    return default_gen().get_state();
  });
  m.def("_set_rng_state", [](const at::Tensor& s) {
    std::lock_guard<std::mutex> lock(default_gen().mutex());
    default_gen().set_state(s);
  });
  m.def("_handle", [](const at::Tensor& t) { return impl_of(t)->opaque_handle().t; });
}
