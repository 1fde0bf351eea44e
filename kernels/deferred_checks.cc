// DeferredChecks: which deferred input error goes to which thread (deferred_checks.h).
#include "kernels/deferred_checks.h"

#include <algorithm>
#include <utility>

#include "runtime/error.h"

namespace gpipe {

namespace {
std::string describe(const DeferredCheck& check, cuda::ErrorSlot slot, Device device) {
  const int64_t index = cuda::error_index(slot);
  GPIPE_CHECK(index < check.count && check.message != nullptr,
              std::string(check.op) + ": the error slot flags index " + std::to_string(index) + " of " +
                  std::to_string(check.count));
  return check.message(check, index, cuda::error_value(slot), device);
}
}  // namespace

size_t DeferredChecks::add(const DeferredCheck& check, Owner owner) {
  GPIPE_CHECK(!full(), "more than " + std::to_string(capacity_) + " deferred checks before a read-back");
  pending_.push_back({check, owner});
  return pending_.size() - 1;
}

std::vector<DeferredChecks::Queued> DeferredChecks::take_unread() { return std::exchange(pending_, {}); }

void DeferredChecks::put_back(const std::vector<Queued>& checks) {
  GPIPE_CHECK(pending_.empty(), "a captured step's checks put back over " + std::to_string(pending_.size()) +
                                    " pending ones");
  GPIPE_CHECK(checks.size() <= capacity_, "a captured step with more checks than slots");
  pending_ = checks;
}

bool DeferredChecks::resolve(const cuda::ErrorSlot* slots, Device device) {
  bool flagged = false;
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (slots[i] == cuda::kNoError) continue;
    flagged = true;
    const Queued& p = pending_[i];
    const bool has_one = std::any_of(kept_.begin(), kept_.end(), [&](const Kept& k) { return k.owner == p.owner; });
    if (!has_one) kept_.push_back({p.owner, describe(p.check, slots[i], device), p.check.user_error});
  }
  pending_.clear();
  return flagged;
}

void DeferredChecks::throw_first(Owner caller) {
  auto it = std::find_if(kept_.begin(), kept_.end(), [&](const Kept& k) { return k.owner == caller; });
  if (it == kept_.end()) return;
  const Kept k = *it;
  kept_.erase(it);
  if (k.user_error) throw UserError(k.message);
  throw Error(k.message);
}

std::vector<std::string> DeferredChecks::drain(const cuda::ErrorSlot* slots, Device device) {
  std::vector<std::string> out;
  for (const Kept& k : kept_) out.push_back(k.message);
  kept_.clear();
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (slots == nullptr || slots[i] == cuda::kNoError || pending_[i].check.message == nullptr) continue;
    try {
      out.push_back(std::string(pending_[i].check.op) + ": " + describe(pending_[i].check, slots[i], device));
    } catch (const std::exception&) {
    }
  }
  pending_.clear();
  return out;
}

}  // namespace gpipe
