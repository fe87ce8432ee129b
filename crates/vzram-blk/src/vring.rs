//! The vring type the backend serves: vhost-user-backend's [`VringRwLock`]
//! with one difference, taken from libvhost-user: when the frontend hands
//! over a call fd (SET_VRING_CALL), it is signalled once right away.
//!
//! A frontend that reconnects may have missed completions the old
//! connection sent (or never sent) to its previous call fd; an interrupt on
//! the new one makes the guest driver look at the used ring again instead
//! of waiting for a completion that already happened. libvhost-user does
//! this "in case of I/O hang after reconnecting", and QEMU's vhost-user-blk
//! qtest (`idx` case) waits for that interrupt. A spurious interrupt costs
//! the guest one look at an unchanged used ring.
//!
//! vhost-user-backend has no hook for SET_VRING_CALL, but it sets the fd
//! through [`VringT::set_call`] of the backend's vring type, which is ours.

use std::fs::File;
use std::io;

use vhost_user_backend::{VringRwLock, VringStateGuard, VringStateMutGuard, VringT};
use virtio_queue::Error as QueueError;
use vm_memory::GuestAddressSpace;

/// [`VringRwLock`], signalling each call fd it is given once.
#[derive(Clone)]
pub struct BlkVring<M: GuestAddressSpace>(VringRwLock<M>);

impl<'a, M: 'a + GuestAddressSpace> VringStateGuard<'a, M> for BlkVring<M> {
    type G = <VringRwLock<M> as VringStateGuard<'a, M>>::G;
}

impl<'a, M: 'a + GuestAddressSpace> VringStateMutGuard<'a, M> for BlkVring<M> {
    type G = <VringRwLock<M> as VringStateMutGuard<'a, M>>::G;
}

impl<M: 'static + GuestAddressSpace> VringT<M> for BlkVring<M> {
    fn new(mem: M, max_queue_size: u16) -> Result<Self, QueueError> {
        VringRwLock::new(mem, max_queue_size).map(BlkVring)
    }

    fn get_ref(&self) -> <Self as VringStateGuard<'_, M>>::G {
        self.0.get_ref()
    }

    fn get_mut(&self) -> <Self as VringStateMutGuard<'_, M>>::G {
        self.0.get_mut()
    }

    fn add_used(&self, desc_index: u16, len: u32) -> Result<(), QueueError> {
        self.0.add_used(desc_index, len)
    }

    fn signal_used_queue(&self) -> io::Result<()> {
        self.0.signal_used_queue()
    }

    fn enable_notification(&self) -> Result<bool, QueueError> {
        self.0.enable_notification()
    }

    fn disable_notification(&self) -> Result<(), QueueError> {
        self.0.disable_notification()
    }

    fn needs_notification(&self) -> Result<bool, QueueError> {
        self.0.needs_notification()
    }

    fn set_enabled(&self, enabled: bool) {
        self.0.set_enabled(enabled)
    }

    fn set_queue_info(
        &self,
        desc_table: u64,
        avail_ring: u64,
        used_ring: u64,
    ) -> Result<(), QueueError> {
        self.0.set_queue_info(desc_table, avail_ring, used_ring)
    }

    fn queue_next_avail(&self) -> u16 {
        self.0.queue_next_avail()
    }

    fn set_queue_next_avail(&self, base: u16) {
        self.0.set_queue_next_avail(base)
    }

    fn set_queue_next_used(&self, idx: u16) {
        self.0.set_queue_next_used(idx)
    }

    fn queue_used_idx(&self) -> Result<u16, QueueError> {
        self.0.queue_used_idx()
    }

    fn set_queue_size(&self, num: u16) {
        self.0.set_queue_size(num)
    }

    fn set_queue_event_idx(&self, enabled: bool) {
        self.0.set_queue_event_idx(enabled)
    }

    fn set_queue_ready(&self, ready: bool) {
        self.0.set_queue_ready(ready)
    }

    fn set_kick(&self, file: Option<File>) {
        self.0.set_kick(file)
    }

    fn read_kick(&self) -> io::Result<bool> {
        self.0.read_kick()
    }

    /// Takes the new call fd and, if there is one, signals it once (see the
    /// module documentation). `None` (GET_VRING_BASE stopping the ring)
    /// signals nothing.
    fn set_call(&self, file: Option<File>) {
        let signal = file.is_some();
        self.0.set_call(file);
        // A queue thread may signal the new fd in between: one more
        // spurious interrupt, no harm.
        if signal {
            if let Err(e) = self.0.signal_used_queue() {
                tracing::warn!("cannot signal the new call fd: {e}");
            }
        }
    }

    fn set_err(&self, file: Option<File>) {
        self.0.set_err(file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{FromRawFd, IntoRawFd};
    use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    type Mem = GuestMemoryAtomic<GuestMemoryMmap>;

    fn as_file(e: &EventFd) -> File {
        let dup = e.try_clone().unwrap();
        // SAFETY: `dup` is a new descriptor that we own and give away here.
        unsafe { File::from_raw_fd(dup.into_raw_fd()) }
    }

    #[test]
    fn a_new_call_fd_is_signalled_once() {
        let v: BlkVring<Mem> =
            BlkVring::new(GuestMemoryAtomic::new(GuestMemoryMmap::new()), 16).unwrap();
        let call = EventFd::new(EFD_NONBLOCK).unwrap();
        v.set_call(Some(as_file(&call)));
        assert_eq!(call.read().unwrap(), 1, "signalled once");
        assert!(call.read().is_err(), "and only once");
        // Taking the fd away (GET_VRING_BASE) signals nothing.
        v.set_call(None);
        let other = EventFd::new(EFD_NONBLOCK).unwrap();
        v.set_call(Some(as_file(&other)));
        assert_eq!(other.read().unwrap(), 1);
        assert!(call.read().is_err(), "the old fd is left alone");
    }
}
