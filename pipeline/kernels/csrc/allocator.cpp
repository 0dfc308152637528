// The train ranks' CPU allocator (pipeline/kernels/allocator.py): tensors of kLarge bytes and more come from one region
// of their own, best fit with coalescing, their pages kept; smaller ones from the allocator PyTorch had before.
#include <pybind11/pybind11.h>  // not <torch/extension.h>: a build 35 -> 10 s
#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>

namespace {

constexpr size_t kLarge = 256 << 10;
constexpr size_t kPage = 4096;

class RegionAllocator final : public c10::Allocator {
 public:
  RegionAllocator(char* base, size_t capacity, c10::Allocator* fallback)
      : base_(base), capacity_(capacity), fallback_(fallback) {}

  c10::DataPtr allocate(size_t n) override {
    char* p = n < kLarge ? nullptr : take((n + kPage - 1) / kPage * kPage);
    if (p == nullptr) return fallback_->allocate(n);  // small, or the region is full
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  // raw_allocate / raw_deallocate (oneDNN's buffers) free through this: ours by address, others as the fallback does
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  static void release(void* p);

  int64_t high_water() const { return static_cast<int64_t>(high_water_); }
  int64_t free_blocks() {
    std::lock_guard<std::mutex> guard(mutex_);
    return static_cast<int64_t>(by_address_.size());
  }

 private:
  char* take(size_t size) {
    std::lock_guard<std::mutex> guard(mutex_);
    char* p;
    auto fit = by_size_.lower_bound({size, nullptr});  // the smallest free block that holds it
    if (fit != by_size_.end()) {
      const size_t found = fit->first;
      p = fit->second;
      by_size_.erase(fit);
      by_address_.erase(p);
      if (found > size) add_free(p + size, found - size);
    } else {  // from the untouched top of the region
      if (top_ + size > capacity_) return nullptr;
      p = base_ + top_;
      top_ += size;
      high_water_ = std::max(high_water_, top_);
    }
    used_[p] = size;
    return p;
  }

  void give_back(char* p) {
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = used_.find(p);
    TORCH_CHECK(it != used_.end(), "cpu_allocator: freeing a block it did not give");
    size_t size = it->second;
    used_.erase(it);
    auto next = by_address_.find(p + size);
    if (next != by_address_.end()) {
      size += next->second;
      remove_free(next);
    }
    auto prev = by_address_.lower_bound(p);
    if (prev != by_address_.begin() && std::prev(prev)->first + std::prev(prev)->second == p) {
      --prev;
      p = prev->first;
      size += prev->second;
      remove_free(prev);
    }
    if (p + size == base_ + top_) {
      top_ -= size;  // back into the top (its pages stay: the next step touches them again)
    } else {
      add_free(p, size);
    }
  }

  void add_free(char* p, size_t size) {
    by_address_[p] = size;
    by_size_.insert({size, p});
  }

  void remove_free(std::map<char*, size_t>::iterator it) {
    by_size_.erase({it->second, it->first});
    by_address_.erase(it);
  }

  bool owns(void* p) const { return p >= base_ && p < base_ + capacity_; }

  char* base_;
  size_t capacity_, top_ = 0, high_water_ = 0;
  c10::Allocator* fallback_;
  std::mutex mutex_;
  std::map<char*, size_t> by_address_;
  std::set<std::pair<size_t, char*>> by_size_;
  std::unordered_map<char*, size_t> used_;
};

RegionAllocator* installed = nullptr;

void RegionAllocator::release(void* p) {
  if (installed->owns(p)) {
    installed->give_back(static_cast<char*>(p));
  } else {
    installed->fallback_->raw_deleter()(p);
  }
}

}  // namespace

// Reserve `capacity` bytes of address space (no memory until touched) and make the allocator PyTorch's CPU allocator
// for every tensor allocated from now on; false where the reservation is refused.
bool install(int64_t capacity) {
  if (installed != nullptr) return true;
  void* base = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return false;
  installed = new RegionAllocator(static_cast<char*>(base), static_cast<size_t>(capacity), c10::GetCPUAllocator());
  c10::SetCPUAllocator(installed, /*priority=*/1);
  return true;
}

// The region's high-water mark (bytes) and its free blocks below the top: how far it reached, how split it is.
std::pair<int64_t, int64_t> usage() {
  return installed ? std::make_pair(installed->high_water(), installed->free_blocks()) : std::make_pair(0L, 0L);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("usage", &usage);
}
