// server/pass_batcher.h — when a job's lagged partials leave for the parent (--lagged-hold-ms).
//
// A lagged round's global result is needed at the layer's next call, a training step later, so
// its partial need not leave the moment the node's round completes. Sent one by one, every
// lagged round costs a message and a wake-up on each hop (sidecar, link, root, link, sidecar,
// workers); held until the pass ends, a pass's partials travel as one batch frame, its answers
// come back batched, and the late results reach the workers in fewer messages.
//
// Passes are runs of a job's forwarded partials of one phase (a forward pass, a backward pass),
// whatever their scope. A lagged partial is held; the held ones leave, in their order, before:
//   - any other frame of the job (a partial of another scope, an abort, layer names): the parent
//     sees a node's frames in the order the node made them;
//   - a partial of the other phase (the pass ended);
//   - a second lagged partial of a layer (op) already held: a new call of that layer, which
//     wants its previous call's result now.
// They leave after a lagged partial that completes the pass: once the pass has had every layer
// (op) the previous pass of its phase had, lagged or not, it is taken as over (the last layer of
// a forward pass, the first layer of a backward pass, in a step like the one before). And they leave at the latest `hold` after
// the first of them was held (the aggregator's tick checks Due), whatever the job does next.
//
// Pure logic (no clock of its own, no locks, no I/O): ParentLink keeps one per job under its
// lock and acts on the Steps.
#ifndef HSBN_SERVER_PASS_BATCHER_H_
#define HSBN_SERVER_PASS_BATCHER_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <set>

namespace hsbn::server {

class PassBatcher {
 public:
  using Clock = std::chrono::steady_clock;

  // What to do with a frame of the job: send the held frames first (flush_before); hold this
  // one (hold; else send it); then send every held frame, this one included (flush_after).
  struct Step {
    bool flush_before = false;
    bool hold = false;
    bool flush_after = false;
  };

  // A frame of the job: a partial (phase 0 forward, 1 backward; `lagged` when of lagged scope)
  // or, with phase < 0, any other frame.
  Step Next(bool lagged, uint32_t op, int phase, Clock::time_point now) {
    Step s;
    if (phase != 0 && phase != 1) {
      s.flush_before = holding();
      held_ops_.clear();
      return s;
    }
    if (phase != pass_phase_) {  // a new pass
      if (pass_phase_ >= 0) previous_[pass_phase_] = pass_ops_;
      pass_ops_.clear();
      pass_phase_ = phase;
    }
    pass_ops_.insert(op);
    if (!lagged) {
      s.flush_before = holding();
      held_ops_.clear();
      return s;
    }
    if (holding() && (held_phase_ != phase || held_ops_.count(op) > 0)) s.flush_before = true;
    if (s.flush_before || !holding()) {
      held_ops_.clear();
      held_phase_ = phase;
      since_ = now;
    }
    s.hold = true;
    held_ops_.insert(op);
    const std::set<uint32_t>& before = previous_[phase];
    if (!before.empty() &&
        std::includes(pass_ops_.begin(), pass_ops_.end(), before.begin(), before.end())) {
      s.flush_after = true;
    }
    if (s.flush_after) held_ops_.clear();
    return s;
  }

  // The held frames were sent (by a Step's flush or because they were Due).
  void Flushed() { held_ops_.clear(); }

  bool holding() const { return !held_ops_.empty(); }
  // Frames are held, the first of them `hold` or longer ago.
  bool Due(Clock::time_point now, Clock::duration hold) const {
    return holding() && now - since_ >= hold;
  }

 private:
  int pass_phase_ = -1;                  // the phase of the current pass; -1 before the first
  std::set<uint32_t> pass_ops_;           // the layers of the current pass (any scope)
  std::set<uint32_t> previous_[2];        // ... of the previous pass of each phase
  std::set<uint32_t> held_ops_;           // the layers held now
  int held_phase_ = -1;
  Clock::time_point since_;               // when the first of them was held
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_PASS_BATCHER_H_
