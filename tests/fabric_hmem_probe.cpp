// Probe: can a libfabric provider move bytes into and out of a memory kind through RMA writes?
//
//   fabric_hmem_probe PROVIDER host|cuda [BYTES]
//
// Why: a libfabric build can list FI_HMEM (shm does even without CUDA: host memory is an HMEM interface)
// and still be unable to register device memory. This opens one RDM endpoint of PROVIDER, addresses itself,
// registers a region of the memory kind (cuda: asking for FI_HMEM, iface FI_HMEM_CUDA), and writes a pattern
// host -> region and region -> host, checking every byte. `cuda` needs the probe compiled with
// -DPROBE_CUDA (linking the CUDA runtime) and a GPU. Used by tests/test_libfabric_build.py; exits 0 and
// prints "ok ..." on success, else 1 with the failing call.
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#ifdef PROBE_CUDA
#include <cuda_runtime.h>
#endif

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void check(int rc, const char* what) {
  if (rc != 0) throw Failure(std::string(what) + " failed: " + fi_strerror(-rc) + " (" + std::to_string(rc) + ")");
}

// Closes any libfabric object (fid) when the scope ends.
struct FidCloser {
  void operator()(fid* f) const { if (f) fi_close(f); }
};
using Fid = std::unique_ptr<fid, FidCloser>;

// The region under test: device memory (cuda) or page-aligned host memory (host).
class Region {
 public:
  Region(bool cuda, size_t bytes) : cuda_(cuda), bytes_(bytes) {
    if (cuda_) {
#ifdef PROBE_CUDA
      cudaError_t e = cudaMalloc(&ptr_, bytes_);
      if (e != cudaSuccess) throw Failure(std::string("cudaMalloc failed: ") + cudaGetErrorString(e));
#else
      throw Failure("this probe was compiled without -DPROBE_CUDA: cuda memory unavailable");
#endif
    } else if (posix_memalign(&ptr_, 4096, bytes_) != 0) {
      throw Failure("posix_memalign failed");
    }
  }
  ~Region() {
#ifdef PROBE_CUDA
    if (cuda_) { cudaFree(ptr_); return; }
#endif
    free(ptr_);
  }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  void* ptr() const { return ptr_; }
  bool cuda() const { return cuda_; }
  void read(void* dst) const { copy(dst, ptr_, false); }
  void write(const void* src) { copy(ptr_, src, true); }

 private:
  void copy(void* dst, const void* src, bool to_region) const {
#ifdef PROBE_CUDA
    if (cuda_) {
      cudaError_t e = cudaMemcpy(dst, src, bytes_, to_region ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);
      if (e != cudaSuccess) throw Failure(std::string("cudaMemcpy failed: ") + cudaGetErrorString(e));
      return;
    }
#endif
    (void)to_region;
    memcpy(dst, src, bytes_);
  }
  bool cuda_;
  size_t bytes_;
  void* ptr_ = nullptr;
};

struct Endpoint {
  Fid fabric, domain, av, cq, ep;
  fi_addr_t self = FI_ADDR_UNSPEC;
  uint64_t mr_mode = 0;
  uint64_t mr_count = 0;
};

Endpoint open_endpoint(fi_info* info) {
  Endpoint e;
  fid_fabric* fabric = nullptr;
  check(fi_fabric(info->fabric_attr, &fabric, nullptr), "fi_fabric");
  e.fabric.reset(&fabric->fid);
  fid_domain* domain = nullptr;
  check(fi_domain(fabric, info, &domain, nullptr), "fi_domain");
  e.domain.reset(&domain->fid);
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  fid_av* av = nullptr;
  check(fi_av_open(domain, &av_attr, &av, nullptr), "fi_av_open");
  e.av.reset(&av->fid);
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_CONTEXT;
  fid_cq* cq = nullptr;
  check(fi_cq_open(domain, &cq_attr, &cq, nullptr), "fi_cq_open");
  e.cq.reset(&cq->fid);
  fid_ep* ep = nullptr;
  check(fi_endpoint(domain, info, &ep, nullptr), "fi_endpoint");
  e.ep.reset(&ep->fid);
  check(fi_ep_bind(ep, &av->fid, 0), "fi_ep_bind(av)");
  check(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
  check(fi_enable(ep), "fi_enable");
  std::vector<char> name(256);
  size_t len = name.size();
  check(fi_getname(&ep->fid, name.data(), &len), "fi_getname");
  if (fi_av_insert(av, name.data(), 1, &e.self, 0, nullptr) != 1) throw Failure("fi_av_insert of the endpoint's own address failed");
  e.mr_mode = info->domain_attr->mr_mode;
  return e;
}

Fid register_region(Endpoint& e, void* ptr, size_t bytes, bool cuda, uint64_t access, fid_mr** out) {
  iovec iov{ptr, bytes};
  fi_mr_attr attr{};
  attr.mr_iov = &iov;
  attr.iov_count = 1;
  attr.access = access;
  attr.iface = cuda ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
  attr.device.cuda = 0;
  attr.requested_key = ++e.mr_count;  // used where the provider does not pick keys (no FI_MR_PROV_KEY)
  fid_mr* mr = nullptr;
  check(fi_mr_regattr(reinterpret_cast<fid_domain*>(e.domain.get()), &attr, 0, &mr),
        cuda ? "fi_mr_regattr(FI_HMEM_CUDA)" : "fi_mr_regattr(FI_HMEM_SYSTEM)");
  Fid owned(&mr->fid);
  if (e.mr_mode & FI_MR_ENDPOINT) {
    check(fi_mr_bind(mr, e.ep.get(), 0), "fi_mr_bind");
    check(fi_mr_enable(mr), "fi_mr_enable");
  }
  *out = mr;
  return owned;
}

// One write of `bytes` from local (desc) to the endpoint itself at remote (key), waited for on the CQ.
void write_and_wait(Endpoint& e, void* local, fid_mr* local_mr, void* remote, fid_mr* remote_mr, size_t bytes) {
  auto* ep = reinterpret_cast<fid_ep*>(e.ep.get());
  auto* cq = reinterpret_cast<fid_cq*>(e.cq.get());
  uint64_t addr = (e.mr_mode & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(remote) : 0;
  ssize_t rc;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  fi_context2 ctx{};
  iovec iov{local, bytes};
  void* desc = fi_mr_desc(local_mr);
  fi_rma_iov rma{addr, bytes, fi_mr_key(remote_mr)};
  fi_msg_rma msg{};
  msg.msg_iov = &iov;
  msg.desc = &desc;
  msg.iov_count = 1;
  msg.addr = e.self;
  msg.rma_iov = &rma;
  msg.rma_iov_count = 1;
  msg.context = &ctx;
  // Delivery-complete: the completion means the bytes are in the target region, not merely sent.
  do {
    rc = fi_writemsg(ep, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE);
    if (rc == -FI_EAGAIN) fi_cq_read(cq, nullptr, 0);  // progress
  } while (rc == -FI_EAGAIN && std::chrono::steady_clock::now() < deadline);
  check(static_cast<int>(rc), "fi_writemsg(FI_DELIVERY_COMPLETE)");
  fi_cq_entry entry{};
  while (true) {
    ssize_t n = fi_cq_read(cq, &entry, 1);
    if (n == 1) return;
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      fi_cq_readerr(cq, &err, 0);
      throw Failure(std::string("the write completed with error: ") + fi_strerror(err.err));
    }
    if (n != -FI_EAGAIN) check(static_cast<int>(n), "fi_cq_read");
    if (std::chrono::steady_clock::now() > deadline) throw Failure("the write did not complete within 30 s");
  }
}

int run(const std::string& provider, bool cuda, size_t bytes) {
  fi_info* hints = fi_allocinfo();
  if (!hints) throw Failure("fi_allocinfo failed");
  std::unique_ptr<fi_info, void (*)(fi_info*)> hints_owner(hints, fi_freeinfo);
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_RMA | (cuda ? FI_HMEM : 0);
  hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_HMEM | FI_MR_ENDPOINT;
  hints->fabric_attr->prov_name = strdup(provider.c_str());
  fi_info* info = nullptr;
  check(fi_getinfo(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), nullptr, nullptr, 0, hints, &info),
        ("fi_getinfo(" + provider + (cuda ? ", FI_RMA | FI_HMEM)" : ", FI_RMA)")).c_str());
  std::unique_ptr<fi_info, void (*)(fi_info*)> info_owner(info, fi_freeinfo);

  Endpoint e = open_endpoint(info);
  Region region(cuda, bytes);
  std::vector<unsigned char> host(bytes), back(bytes);
  for (size_t i = 0; i < bytes; ++i) host[i] = static_cast<unsigned char>((i * 7 + 3) % 251);

  fid_mr *region_mr = nullptr, *host_mr = nullptr;
  Fid region_owner = register_region(e, region.ptr(), bytes, cuda, FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE, &region_mr);
  Fid host_owner = register_region(e, host.data(), bytes, false, FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE, &host_mr);

  // host -> region, checked by reading the region back.
  write_and_wait(e, host.data(), host_mr, region.ptr(), region_mr, bytes);
  region.read(back.data());
  for (size_t i = 0; i < bytes; ++i)
    if (back[i] != host[i]) throw Failure("host -> region: byte " + std::to_string(i) + " differs");
  // region -> host, with the region changed first so the bytes must come from it.
  for (size_t i = 0; i < bytes; ++i) back[i] = static_cast<unsigned char>(255 - host[i]);
  region.write(back.data());
  memset(host.data(), 0, bytes);
  write_and_wait(e, region.ptr(), region_mr, host.data(), host_mr, bytes);
  for (size_t i = 0; i < bytes; ++i)
    if (host[i] != back[i]) throw Failure("region -> host: byte " + std::to_string(i) + " differs");
  printf("ok %s %s: %zu bytes host -> region -> host (libfabric %u.%u)\n", provider.c_str(), cuda ? "cuda" : "host",
         bytes, FI_MAJOR(fi_version()), FI_MINOR(fi_version()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || (std::string(argv[2]) != "host" && std::string(argv[2]) != "cuda")) {
    fprintf(stderr, "usage: %s PROVIDER host|cuda [BYTES]\n", argv[0]);
    return 2;
  }
  size_t bytes = argc > 3 ? strtoull(argv[3], nullptr, 10) : (1 << 20);
  if (bytes == 0) {
    fprintf(stderr, "BYTES must be a positive integer, got '%s'\n", argv[3]);
    return 2;
  }
  try {
    return run(argv[1], std::string(argv[2]) == "cuda", bytes);
  } catch (const Failure& f) {
    fprintf(stderr, "%s %s: %s\n", argv[1], argv[2], f.what());
    return 1;
  }
}
