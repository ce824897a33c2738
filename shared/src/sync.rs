//! The one lock policy of the daemon and its stores.
//!
//! mlxbcd survives panics by design (a job that panics fails that job; a
//! connection task that panics ends that connection), so a mutex may be
//! poisoned while the daemon keeps serving. Every value behind these
//! locks is left whole between statements (counters, sets, maps changed in
//! one call), so a poisoned lock is taken as is: refusing it would turn
//! one failed request into a daemon that fails every request after it.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, taking it as is if a holder panicked.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_poisoned_by_a_panicking_holder_is_still_usable() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let held = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = held.lock().unwrap();
            panic!("a job's bug");
        })
        .join();
        assert!(m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }
}
