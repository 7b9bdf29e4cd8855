// server/event.h — completion-queue tags for the aggregator's one event thread.
//
// Every asynchronous gRPC operation of the aggregator (server calls and the sidecar's link to
// its root) completes on one grpc::ServerCompletionQueue, which one thread of the Aggregator
// drains with Next(). The tag of each operation is an EventTag; the event thread runs its
// OnEvent inline. A call-state object embeds one tag per kind of operation it can have in
// flight (read, write, finish, ...), so the tag says both which call and which operation.
#ifndef HSBN_SERVER_EVENT_H_
#define HSBN_SERVER_EVENT_H_

namespace hsbn::server {

class EventTag {
 public:
  virtual void OnEvent(bool ok) = 0;

 protected:
  ~EventTag() = default;
};

// Calls (owner->*F)(ok) when its operation completes.
template <typename T>
class MemberTag final : public EventTag {
 public:
  MemberTag(T* owner, void (T::*fn)(bool)) : owner_(owner), fn_(fn) {}
  void OnEvent(bool ok) override { (owner_->*fn_)(ok); }

 private:
  T* const owner_;
  void (T::*const fn_)(bool);
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_EVENT_H_
