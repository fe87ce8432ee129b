//! The devices the supervisor serves, and the states no device serves.
//!
//! A device keeps its index for life (a removed one leaves a hole), so an
//! index a client learnt from `stat` never names another device. Adding,
//! forgetting and serving a left-over again happen one at a time, so names
//! and sockets stay unique and a state is never both served and left over.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use vzram_store::Leftover;

use super::served::Served;

pub struct Registry {
    devices: RwLock<Vec<Option<Arc<Served>>>>,
    changing: Mutex<()>,
    /// States in the state dirs that no device serves (found at start).
    leftovers: Mutex<Vec<Leftover>>,
    /// Left-over states of devices removed while connected (`remove
    /// --force`): a reload never discards one (fresh=true in the file).
    cut_off: Mutex<HashSet<PathBuf>>,
}

impl Registry {
    pub fn new(devices: Vec<Arc<Served>>) -> Registry {
        Registry {
            devices: RwLock::new(devices.into_iter().map(Some).collect()),
            changing: Mutex::new(()),
            leftovers: Mutex::new(Vec::new()),
            cut_off: Mutex::new(HashSet::new()),
        }
    }

    /// Device `i`, if it exists (and was not removed).
    pub fn get(&self, i: usize) -> Option<Arc<Served>> {
        let list = self.devices.read().unwrap_or_else(|e| e.into_inner());
        list.get(i).cloned().flatten()
    }

    /// Every device, with its index.
    pub fn all(&self) -> Vec<(usize, Arc<Served>)> {
        let list = self.devices.read().unwrap_or_else(|e| e.into_inner());
        list.iter()
            .enumerate()
            .filter_map(|(i, d)| d.clone().map(|d| (i, d)))
            .collect()
    }

    /// Held while the set of devices or left-overs changes by request
    /// (`add`, `forget`): one change at a time.
    pub fn changing(&self) -> MutexGuard<'_, ()> {
        lock(&self.changing)
    }

    /// A new device, served from now on; returns its index.
    pub fn insert(&self, d: Served) -> usize {
        let mut list = self.devices.write().unwrap_or_else(|e| e.into_inner());
        list.push(Some(Arc::new(d)));
        list.len() - 1
    }

    /// Device `i` is gone; its index stays unused.
    pub fn remove(&self, i: usize) {
        let mut list = self.devices.write().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = list.get_mut(i) {
            *slot = None;
        }
    }

    /// The state in `dir` is served again (or deleted): not left over.
    pub fn served_again(&self, dir: &Path) {
        self.leftovers().retain(|l| l.dir != dir);
        lock(&self.cut_off).remove(dir);
    }

    /// The states no device serves.
    pub fn leftovers(&self) -> MutexGuard<'_, Vec<Leftover>> {
        lock(&self.leftovers)
    }

    /// The state in `dir` was cut off from its frontend (`remove --force`).
    pub fn cut_off(&self, dir: PathBuf) {
        lock(&self.cut_off).insert(dir);
    }

    /// Whether the state in `dir` was cut off from its frontend.
    pub fn was_cut_off(&self, dir: &Path) -> bool {
        lock(&self.cut_off).contains(dir)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leftover(name: &str) -> Leftover {
        Leftover {
            name: name.into(),
            dir: PathBuf::from("/state").join(name),
            size_bytes: 1 << 20,
            bytes: 4096,
            socket: None,
            creation_id: 1,
        }
    }

    #[test]
    fn a_state_served_again_is_neither_left_over_nor_cut_off() {
        let r = Registry::new(Vec::new());
        r.leftovers().extend([leftover("a"), leftover("b")]);
        r.cut_off(PathBuf::from("/state/a"));
        assert!(r.was_cut_off(Path::new("/state/a")));
        r.served_again(Path::new("/state/a"));
        assert!(!r.was_cut_off(Path::new("/state/a")));
        let names: Vec<String> = r.leftovers().iter().map(|l| l.name.clone()).collect();
        assert_eq!(names, ["b"]);
        assert!(r.all().is_empty() && r.get(0).is_none());
    }
}
