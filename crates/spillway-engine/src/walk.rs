//! Walks over every queue of a vhost, a chunk at a time: what management's
//! lists, message totals and the broker's status, and the `/metrics`
//! per-queue gauges, use to look at every queue without holding the broker
//! lock for all of them.
//!
//! A walk takes the lock for [`WALK_CHUNK`] queues, in name order, then lets
//! it go (fairly: a thread waiting for it gets it first) and, when async,
//! yields its worker thread, and resumes after the last name it saw
//! ([`VHost::queue_names_after`](crate::vhost::VHost::queue_names_after)).
//! With 100,000 queues a publisher so waits for one chunk at most, never
//! for a whole list. What a walk answers is therefore not a snapshot, as
//! RabbitMQ's lists are not: a queue declared or deleted during the walk may
//! or may not be in it; a queue there throughout is in it exactly once.
//!
//! Nothing here changes the broker.

use spillway_proto::ServiceError;

use crate::broker::Broker;
use crate::queue::Queue;
use crate::shared::Shared;

/// The queues a walk looks at under one hold of the broker lock.
pub(crate) const WALK_CHUNK: usize = 1_000;

/// Calls `visit` with every queue of `vhost_name`, in name order,
/// [`WALK_CHUNK`] at a time, yielding between chunks. A vhost missing at the
/// start is `NotFound`; one deleted during the walk ends it.
pub(crate) async fn walk_queues(
    shared: &Shared,
    vhost_name: &str,
    mut visit: impl FnMut(&Broker, &Queue),
) -> Result<(), ServiceError> {
    let mut after: Option<String> = None;
    loop {
        after = match walk_chunk(shared, vhost_name, after.as_deref(), &mut visit) {
            Ok(Some(last)) => Some(last),
            Ok(None) => return Ok(()),
            Err(_) if after.is_some() => return Ok(()),
            Err(error) => return Err(error),
        };
        #[cfg(test)]
        hooks::between_chunks(shared);
        tokio::task::yield_now().await;
    }
}

/// As [`walk_queues`], for callers that cannot wait (a `/metrics` scrape):
/// the lock is still let go between chunks, the thread is not yielded.
pub(crate) fn walk_queues_blocking(
    shared: &Shared,
    vhost_name: &str,
    mut visit: impl FnMut(&Broker, &Queue),
) {
    let mut after: Option<String> = None;
    while let Ok(Some(last)) = walk_chunk(shared, vhost_name, after.as_deref(), &mut visit) {
        after = Some(last);
        #[cfg(test)]
        hooks::between_chunks(shared);
    }
}

/// One chunk: up to [`WALK_CHUNK`] queues after `after`, under one hold of
/// the lock. Returns the last name seen when more may follow.
fn walk_chunk(
    shared: &Shared,
    vhost_name: &str,
    after: Option<&str>,
    visit: &mut impl FnMut(&Broker, &Queue),
) -> Result<Option<String>, ServiceError> {
    let broker = shared.broker.lock();
    let vhost = broker
        .vhosts
        .get(vhost_name)
        .ok_or_else(|| ServiceError::NotFound(format!("vhost '{vhost_name}' not found")))?;
    let resume = {
        let mut names = vhost.queue_names_after(after);
        let mut last = None;
        for name in names.by_ref().take(WALK_CHUNK) {
            if let Some(queue) = vhost.queues.get(name) {
                visit(&broker, queue);
            }
            last = Some(name);
        }
        last.filter(|_| names.next().is_some()).cloned()
    };
    parking_lot::MutexGuard::unlock_fair(broker);
    Ok(resume)
}

/// What tests watch: the queue views built on this thread, and a hook run
/// between two chunks of a walk on this thread.
#[cfg(test)]
pub(crate) mod hooks {
    use std::cell::{Cell, RefCell};

    use crate::shared::Shared;

    type Hook = Box<dyn FnMut(&Shared)>;

    thread_local! {
        static VIEWS: Cell<usize> = const { Cell::new(0) };
        static BETWEEN_CHUNKS: RefCell<Option<Hook>> = const { RefCell::new(None) };
    }

    pub(crate) fn count_queue_view() {
        VIEWS.with(|views| views.set(views.get() + 1));
    }

    /// Queue views built on this thread so far.
    pub(crate) fn queue_views() -> usize {
        VIEWS.with(Cell::get)
    }

    pub(crate) fn set_between_chunks(hook: Option<Hook>) {
        BETWEEN_CHUNKS.with(|slot| *slot.borrow_mut() = hook);
    }

    pub(super) fn between_chunks(shared: &Shared) {
        BETWEEN_CHUNKS.with(|slot| {
            if let Some(hook) = slot.borrow_mut().as_mut() {
                hook(shared);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::sync::Arc;
    use std::sync::Mutex;

    use spillway_proto::management as m;

    use super::*;
    use crate::config::EngineConfig;
    use crate::engine::Engine;
    use spillway_storage::MemoryStore;

    const QUEUES: usize = 3 * WALK_CHUNK + 17;

    async fn engine_with_queues(count: usize) -> Engine {
        let engine = Engine::start(Arc::new(MemoryStore::new()), EngineConfig::default())
            .await
            .unwrap();
        for i in 0..count {
            engine
                .create_queue(m::CreateQueueRequest {
                    vhost: "/".into(),
                    name: format!("q{i:05}"),
                    ..Default::default()
                })
                .await
                .unwrap();
        }
        engine
    }

    /// Runs `change` on the broker from another thread, which must get the
    /// lock within a deadline: called between two chunks of a walk, it
    /// fails the test if the walk still held the lock there.
    fn change_on_another_thread(shared: &Shared, change: impl FnOnce(&mut Broker) + Send) {
        let taken = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    shared
                        .broker
                        .try_lock_for(std::time::Duration::from_secs(10))
                        .map(|mut broker| change(&mut broker))
                        .is_some()
                })
                .join()
                .unwrap()
        });
        assert!(taken, "the walk held the lock between chunks");
    }

    /// GET /api/queues/{vhost}/{name} used to build every queue of the
    /// vhost under the lock to answer for one.
    #[tokio::test]
    async fn one_queue_is_answered_without_building_the_others() {
        let engine = engine_with_queues(QUEUES).await;
        let before = hooks::queue_views();
        let queue = engine
            .get_queue(m::GetQueueRequest {
                vhost: "/".into(),
                name: "q01234".into(),
            })
            .await
            .unwrap();
        assert_eq!(queue.name, "q01234");
        assert_eq!(hooks::queue_views() - before, 1);
        let missing = engine
            .get_queue(m::GetQueueRequest {
                vhost: "/".into(),
                name: "nope".into(),
            })
            .await;
        assert!(matches!(missing, Err(ServiceError::NotFound(_))));
        assert_eq!(hooks::queue_views() - before, 1);
        let vhost = engine
            .get_vhost(m::GetVhostRequest { name: "/".into() })
            .await
            .unwrap();
        assert_eq!(vhost.queues as usize, QUEUES);
        assert_eq!(hooks::queue_views() - before, 1);
    }

    /// A list of every queue lets the lock go between chunks: another
    /// thread can take it there, and what changes there is seen or not,
    /// while every queue there throughout is listed once, in order.
    #[tokio::test]
    async fn a_queue_list_lets_the_lock_go_between_chunks() {
        let engine = engine_with_queues(QUEUES).await;
        let pauses = Arc::new(Mutex::new(0usize));
        let seen = pauses.clone();
        hooks::set_between_chunks(Some(Box::new(move |shared: &Shared| {
            // Another thread takes the lock here, within a deadline: the
            // walk does not hold it.
            let pause = *seen.lock().unwrap();
            change_on_another_thread(shared, |broker| {
                let vhost = broker.vhosts.get_mut("/").unwrap();
                // One behind the walk, one ahead, one gone.
                vhost.insert_queue(Queue::new(format!("q00000-new{pause}"), false, false, None));
                vhost.insert_queue(Queue::new(format!("zz-new{pause}"), false, false, None));
                vhost.remove_queue(&format!("q{:05}", QUEUES - 1 - pause));
            });
            *seen.lock().unwrap() += 1;
        })));
        let before = hooks::queue_views();
        let listed = engine
            .list_queues(m::ListQueuesRequest { vhost: "/".into() })
            .await
            .unwrap();
        hooks::set_between_chunks(None);
        let pauses = *pauses.lock().unwrap();
        assert!(pauses >= QUEUES / WALK_CHUNK, "{pauses} pauses");
        let names: Vec<&str> = listed.queues.iter().map(|q| q.name.as_str()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(names, sorted, "listed in order, each once");
        // Queues there throughout: all of them, except those deleted.
        for i in 0..QUEUES - pauses {
            let name = format!("q{i:05}");
            assert!(names.contains(&name.as_str()), "{name} missing");
        }
        // Made ahead of the walk: seen; deleted ahead of it: not seen.
        assert!(names.contains(&"zz-new0"));
        assert!(!names.contains(&format!("q{:05}", QUEUES - 1).as_str()));
        assert_eq!(hooks::queue_views() - before, names.len());
    }

    /// Totals walked in chunks add up to what the queues hold.
    #[tokio::test]
    async fn message_totals_and_the_broker_status_count_every_queue() {
        let engine = engine_with_queues(QUEUES).await;
        for name in ["q00001", "q02500", "q03016"] {
            for _ in 0..2 {
                engine
                    .publish_message(m::PublishMessageRequest {
                        vhost: "/".into(),
                        exchange: String::new(),
                        routing_key: name.into(),
                        body: bytes::Bytes::from_static(b"x"),
                        ..Default::default()
                    })
                    .await
                    .unwrap();
            }
        }
        let before = hooks::queue_views();
        let totals = engine
            .vhost_message_totals(spillway_proto::engine::VhostMessageTotalsRequest {
                vhost: String::new(),
            })
            .await
            .unwrap();
        assert_eq!(totals.vhosts.len(), 1);
        assert_eq!(totals.vhosts[0].vhost, "/");
        assert_eq!(totals.vhosts[0].messages_ready, 6);
        let status = engine
            .get_broker_status(m::GetBrokerStatusRequest {})
            .await
            .unwrap();
        assert_eq!(status.queues as usize, QUEUES);
        assert_eq!(status.messages_ready, 6);
        assert_eq!(hooks::queue_views() - before, 0);
        let stats = engine.queue_stats();
        assert_eq!(stats.len(), QUEUES);
        assert_eq!(stats.iter().map(|s| s.messages).sum::<u64>(), 6);
    }

    /// An export reads its queues a chunk at a time and its bindings an
    /// exchange at a time; a queue declared behind the walk is not in it,
    /// and nor is its binding, so the file imports.
    #[tokio::test]
    async fn an_export_lets_the_lock_go_and_holds_only_bindings_to_its_queues() {
        let engine = Engine::start(Arc::new(MemoryStore::new()), EngineConfig::default())
            .await
            .unwrap();
        engine
            .create_exchange(m::CreateExchangeRequest {
                vhost: "/".into(),
                name: "x".into(),
                kind: "direct".into(),
                durable: true,
                ..Default::default()
            })
            .await
            .unwrap();
        let count = 2 * WALK_CHUNK + 5;
        for i in 0..count {
            let name = format!("q{i:05}");
            engine
                .create_queue(m::CreateQueueRequest {
                    vhost: "/".into(),
                    name: name.clone(),
                    durable: true,
                    ..Default::default()
                })
                .await
                .unwrap();
            engine
                .create_binding(m::CreateBindingRequest {
                    binding: Some(m::Binding {
                        vhost: "/".into(),
                        source: "x".into(),
                        destination: name.clone(),
                        routing_key: name,
                        ..Default::default()
                    }),
                })
                .await
                .unwrap();
        }
        let pauses = Arc::new(Mutex::new(0usize));
        let seen = pauses.clone();
        hooks::set_between_chunks(Some(Box::new(move |shared: &Shared| {
            change_on_another_thread(shared, |broker| {
                let vhost = broker.vhosts.get_mut("/").unwrap();
                if vhost.queues.contains_key("a-late") {
                    return;
                }
                vhost.insert_queue(Queue::new("a-late".into(), true, false, None));
                let x = vhost.exchanges.get_mut("x").unwrap();
                x.bindings.insert(crate::model::Binding {
                    destination: crate::model::Destination::Queue("a-late".into()),
                    routing_key: "a-late".into(),
                    arguments: Default::default(),
                });
            });
            *seen.lock().unwrap() += 1;
        })));
        let exported = engine
            .export_definitions(m::ExportDefinitionsRequest { vhost: "/".into() })
            .await
            .unwrap();
        hooks::set_between_chunks(None);
        assert!(*pauses.lock().unwrap() >= 2);
        let queues: Vec<&str> = exported.queues.iter().map(|q| q.name.as_str()).collect();
        assert_eq!(queues.len(), count, "{:?}", &queues[..3]);
        assert!(!queues.contains(&"a-late"));
        assert_eq!(exported.bindings.len(), count);
        assert!(exported.bindings.iter().all(|b| b.destination != "a-late"));
        assert_eq!(exported.exchanges.len(), 1);
        // The list of bindings, read after, has it; one queue's, only its.
        let listed = engine
            .list_bindings(m::ListBindingsRequest {
                vhost: "/".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(listed.bindings.iter().any(|b| b.destination == "a-late"));
        let one = engine
            .list_bindings(m::ListBindingsRequest {
                vhost: "/".into(),
                destination: "q00007".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(one.bindings.len(), 1);
        assert_eq!(
            (
                one.bindings[0].source.as_str(),
                one.bindings[0].routing_key.as_str()
            ),
            ("x", "q00007")
        );
    }
}
