module @jit_s0_bwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<2x16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}, %arg2: tensor<2x8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}, %arg3: tensor<2x8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}, %arg4: tensor<2x8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}, %arg5: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg6: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<8x16xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<2x16x16xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}) {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<2x16x16xf32>
    %c = stablehlo.constant dense<0> : tensor<i32>
    %1:7 = stablehlo.while(%iterArg = %arg1, %iterArg_2 = %arg2, %iterArg_3 = %arg3, %iterArg_4 = %arg4, %iterArg_5 = %c, %iterArg_6 = %arg0, %iterArg_7 = %0) : tensor<2x16x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<i32>, tensor<8x16xf32>, tensor<2x16x16xf32>
    cond {
      %c_8 = stablehlo.constant dense<2> : tensor<i32>
      %10 = stablehlo.compare LT, %iterArg_5, %c_8, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %10 : tensor<i1>
    } do {
      %c_8 = stablehlo.constant dense<2> : tensor<i32>
      %10 = stablehlo.subtract %c_8, %iterArg_5 : tensor<i32>
      %c_9 = stablehlo.constant dense<1> : tensor<i32>
      %11 = stablehlo.subtract %10, %c_9 : tensor<i32>
      %12 = func.call @dynamic_index_in_dim(%iterArg, %11) : (tensor<2x16x16xf32>, tensor<i32>) -> tensor<16x16xf32>
      %13 = func.call @dynamic_index_in_dim_0(%iterArg_2, %11) : (tensor<2x8x16xf32>, tensor<i32>) -> tensor<8x16xf32>
      %14 = func.call @dynamic_index_in_dim_0(%iterArg_3, %11) : (tensor<2x8x16xf32>, tensor<i32>) -> tensor<8x16xf32>
      %15 = func.call @dynamic_index_in_dim_0(%iterArg_4, %11) : (tensor<2x8x16xf32>, tensor<i32>) -> tensor<8x16xf32>
      %16:2 = func.call @closed_call(%iterArg_6, %12, %13, %14, %15) : (tensor<8x16xf32>, tensor<16x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>) -> (tensor<8x16xf32>, tensor<16x16xf32>)
      %17 = func.call @dynamic_update_index_in_dim(%iterArg_7, %16#1, %11) : (tensor<2x16x16xf32>, tensor<16x16xf32>, tensor<i32>) -> tensor<2x16x16xf32>
      %c_10 = stablehlo.constant dense<1> : tensor<i32>
      %18 = stablehlo.add %iterArg_5, %c_10 : tensor<i32>
      stablehlo.return %iterArg, %iterArg_2, %iterArg_3, %iterArg_4, %18, %16#0, %17 : tensor<2x16x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<i32>, tensor<8x16xf32>, tensor<2x16x16xf32>
    }
    %2 = stablehlo.dot_general %1#5, %arg5, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<8x8xf32>) -> tensor<16x8xf32>
    %3 = stablehlo.transpose %2, dims = [1, 0] : (tensor<16x8xf32>) -> tensor<8x16xf32>
    %cst_0 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %4 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %5 = stablehlo.multiply %4, %3 : tensor<8x16xf32>
    %6 = stablehlo.subtract %arg6, %5 : tensor<8x16xf32>
    %cst_1 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %7 = stablehlo.broadcast_in_dim %cst_1, dims = [] : (tensor<f32>) -> tensor<2x16x16xf32>
    %8 = stablehlo.multiply %7, %1#6 : tensor<2x16x16xf32>
    %9 = stablehlo.subtract %arg1, %8 : tensor<2x16x16xf32>
    return %6, %9 : tensor<8x16xf32>, tensor<2x16x16xf32>
  }
  func.func private @dynamic_index_in_dim(%arg0: tensor<2x16x16xf32>, %arg1: tensor<i32>) -> tensor<16x16xf32> {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %0 = stablehlo.dynamic_slice %arg0, %arg1, %c, %c_0, sizes = [1, 16, 16] : (tensor<2x16x16xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x16x16xf32>
    %1 = stablehlo.reshape %0 : (tensor<1x16x16xf32>) -> tensor<16x16xf32>
    return %1 : tensor<16x16xf32>
  }
  func.func private @dynamic_index_in_dim_0(%arg0: tensor<2x8x16xf32>, %arg1: tensor<i32>) -> tensor<8x16xf32> {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %0 = stablehlo.dynamic_slice %arg0, %arg1, %c, %c_0, sizes = [1, 8, 16] : (tensor<2x8x16xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x8x16xf32>
    %1 = stablehlo.reshape %0 : (tensor<1x8x16xf32>) -> tensor<8x16xf32>
    return %1 : tensor<8x16xf32>
  }
  func.func private @closed_call(%arg0: tensor<8x16xf32>, %arg1: tensor<16x16xf32>, %arg2: tensor<8x16xf32>, %arg3: tensor<8x16xf32>, %arg4: tensor<8x16xf32>) -> (tensor<8x16xf32>, tensor<16x16xf32>) {
    %0 = stablehlo.multiply %arg0, %arg4 : tensor<8x16xf32>
    %1 = stablehlo.multiply %0, %arg3 : tensor<8x16xf32>
    %2 = stablehlo.add %0, %1 : tensor<8x16xf32>
    %3 = stablehlo.dot_general %2, %arg2, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<16x16xf32>
    %4 = stablehlo.transpose %3, dims = [1, 0] : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %5 = stablehlo.dot_general %2, %arg1, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
    return %5, %4 : tensor<8x16xf32>, tensor<16x16xf32>
  }
  func.func private @dynamic_update_index_in_dim(%arg0: tensor<2x16x16xf32>, %arg1: tensor<16x16xf32>, %arg2: tensor<i32>) -> tensor<2x16x16xf32> {
    %0 = stablehlo.broadcast_in_dim %arg1, dims = [1, 2] : (tensor<16x16xf32>) -> tensor<1x16x16xf32>
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %1 = stablehlo.dynamic_update_slice %arg0, %0, %arg2, %c, %c_0 : (tensor<2x16x16xf32>, tensor<1x16x16xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<2x16x16xf32>
    return %1 : tensor<2x16x16xf32>
  }
}
